"""The Python boundary of the C++ scheduler: arrays out, arrays in, errors as exceptions."""

from __future__ import annotations

import numpy as np
import pytest

from dayzero.sdk.scheduler import CacheGroup, FinishReason, GroupKind, Scheduler, SchedulerError, make_config


def small(**kw) -> Scheduler:
    groups = kw.pop("groups", [CacheGroup("kv", GroupKind.Paged, bytes_per_token=8)])
    return Scheduler(
        make_config(groups, device_bytes=kw.pop("device_bytes", 64 * 16 * 8), block_size=16, **kw)
    )


def answer(s: Scheduler, plan, token: int = 5) -> None:
    counts = plan.sample.astype(np.int32)
    s.feed(plan.req_ids, counts, np.full(int(counts.sum()), token, dtype=np.int32))


def test_plan_arrays_have_the_documented_shapes_and_dtypes():
    s = small()
    s.submit(10, np.arange(1, 41, dtype=np.int32), max_new_tokens=4)
    s.submit(11, list(range(100, 120)), max_new_tokens=4)
    p = s.step()
    assert p.rows == 2
    assert p.req_ids.dtype == np.int64 and p.req_ids.tolist() == [10, 11]
    assert p.num_tokens.tolist() == [40, 20]
    assert p.query_start.tolist() == [0, 40, 60]
    assert p.input_ids.dtype == np.int32 and p.input_ids[:40].tolist() == list(range(1, 41))
    assert p.positions[40:].tolist() == list(range(20))
    (table,) = p.block_tables
    assert table.shape == (2, 3) and table.dtype == np.int32
    assert table[1, 2] == -1  # 20 tokens need two blocks of 16
    assert len(set(table[0].tolist()) | set(table[1, :2].tolist())) == 5
    answer(s, p)
    assert s.phase_of(10) == "Decoding"


def test_plan_views_outlive_later_steps():
    s = small()
    s.submit(1, np.arange(1, 9, dtype=np.int32), max_new_tokens=3)
    p0 = s.step()
    ids = p0.input_ids
    answer(s, p0)
    for _ in range(2):
        answer(s, s.step())
    assert ids.tolist() == list(range(1, 9))  # still the first plan's data


def test_errors_carry_the_cpp_message_and_change_nothing():
    s = small()
    s.submit(1, [1, 2, 3], max_new_tokens=2)
    with pytest.raises(SchedulerError, match="already live"):
        s.submit(1, [1, 2, 3])
    with pytest.raises(SchedulerError, match="exceeds the 1024 tokens of KV memory"):
        s.submit(2, np.arange(1, 1000, dtype=np.int32), max_new_tokens=100)
    with pytest.raises(SchedulerError, match="request 9 is not live"):
        s.abort(9)
    p = s.step()
    with pytest.raises(SchedulerError, match="row 0 is request 1, got 2"):
        s.feed(np.array([2]), np.array([1], dtype=np.int32), np.array([4], dtype=np.int32))
    with pytest.raises(
        SchedulerError, match="event RemoteFillDone is not legal in phase PrefillAwaitingResult"
    ):
        s.remote_fill_done(1, 3)
    assert s.phase_of(1) == "PrefillAwaitingResult"
    answer(s, p)
    assert s.tokens_of(1) == [1, 2, 3, 5]


def test_bad_config_is_refused_with_its_reason():
    with pytest.raises(SchedulerError, match="window"):
        small(groups=[CacheGroup("w", GroupKind.SlidingWindow, bytes_per_token=4)])
    with pytest.raises(SchedulerError, match="need at least 2"):
        small(device_bytes=100)


def test_introspection_counts_stops_and_blocks():
    s = small(max_batch_size=2)
    total = s.total_blocks(0)
    for i in range(3):
        s.submit(i, np.arange(1 + 100 * i, 30 + 100 * i, dtype=np.int32), max_new_tokens=2)
    p = s.step()
    counts = s.phase_counts()
    assert counts["PrefillAwaitingResult"] == 2 and counts["Submitted"] == 1
    assert s.num_running == 2 and s.num_waiting == 1
    assert s.free_blocks(0) == total - 4
    answer(s, p)
    while s.num_live:
        p = s.step()
        if p.rows:
            answer(s, p)
    assert s.flush_prefix_cache() > 0
    assert s.free_blocks(0) == total
    assert s.layout["num_pages"] == total


def test_hybrid_groups_share_one_budget():
    groups = [
        CacheGroup("latent", GroupKind.Paged, bytes_per_token=576 * 2),
        CacheGroup("indexer", GroupKind.Paged, bytes_per_token=132),
        CacheGroup("swa", GroupKind.SlidingWindow, bytes_per_token=512, window=64),
        CacheGroup("ssm", GroupKind.State, state_bytes=1 << 16),
    ]
    s = Scheduler(
        make_config(groups, device_bytes=64 << 20, block_size=64, max_batch_size=8, snapshot_slots=8)
    )
    lay = s.layout
    assert lay["blocks_per_page"] == [1, 8, 2, 0]
    assert lay["padded_row_bytes"][1] == 144
    s.submit(1, np.arange(1, 200, dtype=np.int32), max_new_tokens=2)
    p = s.step()
    assert [t.shape[1] for t in p.block_tables] == [3, 3, 3, 0]
    assert p.state_slots.tolist() == [0]
    s.check_invariants()


def test_make_config_keeps_cpp_defaults_and_refuses_unknown_fields():
    from dayzero.sdk.scheduler import SchedulerConfig

    groups = [CacheGroup("kv", GroupKind.Paged, bytes_per_token=8)]
    cfg = make_config(groups, device_bytes=1 << 20, max_tokens_per_step=512)
    assert cfg.block_size == SchedulerConfig().block_size
    assert cfg.chunk_size == 512
    with pytest.raises(TypeError, match="unknown scheduler field 'blocksize'"):
        make_config(groups, device_bytes=1 << 20, blocksize=16)


def test_a_stop_token_that_is_also_the_last_allowed_token_finishes_as_stop():
    for stop_second, reason in ((True, "STOP"), (False, "LENGTH")):
        s = small()
        s.submit(1, [1, 2, 3], max_new_tokens=2, stop_ids=[9])
        answer(s, s.step(), token=4)
        answer(s, s.step(), token=9 if stop_second else 5)
        p = s.step()
        assert p.finished_ids.tolist() == [1]
        assert FinishReason(int(p.finished_reasons[0])).name == reason
