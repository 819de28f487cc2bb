"""A whole greedy drafting step in one graph (sdk/engine/drafting_graphs.py), in the graphs'
buffers on CPU (fp32): the MTP head's chained drafts, the verify pass, greedy sampling, the drafts
kept and the head's observe, with each request's head state by slot in the HeadTable.

Against the same engine drafting pass by pass (its drafting graphs taken away): the same tokens,
logprobs and drafts, step by step; against a run without drafts: the same tokens and logprobs
(parity's fp32 logprob bound). Steps that do not fit (a prefill chunk, a request asking for top
logprobs, one whose head state is outside the table) run pass by pass between steps in graph,
each kind reading the rows the other left in flight.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from test_speculative import LOGPROB_TOL
from test_speculative_overlap import GREEDY, _drafts_by_request, _prompts, _same, built

from dayzero.sdk.engine.drafters import HeadTable, SpeculativeConfig
from dayzero.sdk.engine.engine import Engine, EngineConfig, SamplingParams
from dayzero.sdk.parity.runner import RETRACTION, retraction_budget

STAGGERED = dict(block_size=4, chunk_size=8, max_tokens_per_step=24)  # prefills spread over steps


@pytest.fixture(scope="module", params=["llama", "glm53"])
def model(request, tmp_path_factory):
    return built(request.param, tmp_path_factory)


def _engine(model, k: int, in_graph: bool, **fields) -> Engine:
    m, cfg, ops = model
    spec = SpeculativeConfig("mtp", k)
    eng = Engine(m, cfg, ops, EngineConfig(decode_graphs="buffers", overlap="on", speculative=spec, **fields))
    assert eng.drafting is not None
    if not in_graph:  # the engine as before the drafting graphs: the head's state in its dict only
        eng.drafting = eng.drafter.table = None
    return eng


@pytest.mark.parametrize("k", [1, 3])
def test_drafting_steps_in_one_graph_decode_as_pass_by_pass(model, k: int) -> None:
    """Prompts of 3..40 tokens prefilled in chunks of 8 (steps with a prefill chunk run pass by
    pass): the tokens and logprobs of a run without drafts, and the drafts, acceptance counts
    and row moves of the same engine drafting pass by pass. Every pass of the head reads
    contiguous per-token tensors (the GPU kernels index them flat: the chained drafts' rows are
    every (k + 1)-th flat row)."""
    m, cfg, ops = model
    prompts = _prompts(cfg, 11)
    base = Engine(m, cfg, ops, EngineConfig(decode_graphs="off")).generate(prompts, GREEDY)
    runs, mtp, strided = {}, m.mtp.forward, []

    def checked(ids, z, ctx, embed, head):
        metas = [x for x in ctx.paged if x is not None]
        flat = [
            ids,
            ctx.positions,
            *(t for x in metas for t in (x.positions, x.kv_lens, x.slots, x.block_table)),
        ]
        strided.extend(t.shape for t in flat if not t.is_contiguous())
        return mtp(ids, z, ctx, embed, head)

    m.mtp.forward = checked
    try:
        for in_graph in (True, False):
            eng = _engine(model, k, in_graph, **STAGGERED)
            seen = _drafts_by_request(eng)
            outs = eng.generate(prompts, GREEDY)
            _same(base, outs)
            runs[in_graph] = (outs, seen, eng.stats)
    finally:
        del m.mtp.forward
    assert not strided, strided
    (g_outs, g_seen, g), (p_outs, p_seen, p) = runs[True], runs[False]
    _same(p_outs, g_outs, 1e-5)
    assert g_seen == p_seen and sorted(g_seen) == list(range(len(prompts)))
    assert g["accepted_at"] == p["accepted_at"] and g["verify_rows"] == p["verify_rows"]
    assert g["drafting_graph_steps"] > 0 and p["drafting_graph_steps"] == 0
    # steps with a prefill chunk waited for the step in flight, the others moved rows on the device
    assert g["rows_moved_on_device"] > 0 and g["rows_moved_on_host"] > 0
    assert (g["rows_moved_on_device"], g["rows_moved_on_host"]) == (
        p["rows_moved_on_device"],
        p["rows_moved_on_host"],
    )


def test_steps_with_a_request_asking_for_top_logprobs_run_pass_by_pass(model) -> None:
    """The longest prompt (its decode starts last) asks for top logprobs and stops first: the
    steps with its rows run pass by pass, those before and after in graph, each moving the rows
    the other kind left in flight; every request decodes as without drafts."""
    m, cfg, ops = model
    prompts = _prompts(cfg, 12)
    tops = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, top_logprobs=2)
    params = [GREEDY, GREEDY, GREEDY, tops]
    base = Engine(m, cfg, ops, EngineConfig(decode_graphs="off")).generate(prompts, params)
    eng = _engine(model, 2, True, **STAGGERED)
    steps: list[tuple[bool, bool]] = []  # (in graph, rows moved on the device)
    inner = eng._launch_verify

    def launch(plan, prev):
        moved = eng.stats["rows_moved_on_device"]
        done = inner(plan, prev)
        steps.append((done.verify.in_graph, eng.stats["rows_moved_on_device"] > moved))
        return done

    eng._launch_verify = launch
    outs = eng.generate(prompts, params)
    _same(base, outs)
    got, want = outs[3].top_logprobs, base[3].top_logprobs
    assert [[t for t, _ in s] for s in got] == [[t for t, _ in s] for s in want] and len(got) == 4
    pairs = [(a, b) for s, w in zip(got, want, strict=True) for (_, a), (_, b) in zip(s, w, strict=True)]
    assert max(abs(a - b) for a, b in pairs) < LOGPROB_TOL
    assert [len(t) for t in got] == [2] * 4
    assert eng.stats["drafting_graph_steps"] > 0
    # a step in graph moving rows behind one pass by pass still in flight, and the other way round
    assert any(not a[0] and b == (True, True) for a, b in itertools.pairwise(steps)), steps
    assert any(a[0] and b == (False, True) for a, b in itertools.pairwise(steps)), steps


def test_requests_whose_head_state_is_outside_the_table_run_pass_by_pass(model) -> None:
    """A table of one slot: the first request to observe takes it, the others' head states stay
    out of it; steps with their rows run pass by pass, and once only the first is left its
    steps run in graph; every token as without drafts."""
    m, cfg, ops = model
    prompts = _prompts(cfg, 13)
    short = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)] + [short] * 3
    base = Engine(m, cfg, ops, EngineConfig(decode_graphs="off")).generate(prompts, params)
    eng = _engine(model, 2, True)
    table = eng.drafting.table
    table.free = table.free[-1:]
    outs = eng.generate(prompts, params)
    _same(base, outs)
    assert eng.stats["drafting_graph_steps"] > 0
    assert eng.stats["graph_steps"] > eng.stats["drafting_graph_steps"]
    assert len(table.free) == 1 and not table.slot  # every slot back once the requests ended


def test_the_head_table_hands_out_slots_and_takes_them_back() -> None:
    t = HeadTable(2, (4,), torch.float32, torch.device("cpu"))
    assert (t.take(7), t.take(9), t.take(7)) == (0, 1, 0)
    assert t.take(11) is None  # full: its state stays out of the table
    t.drop(7)
    assert t.take(11) == 0 and t.slot == {9: 1, 11: 0}
    assert t.zero == len(t.shift) - 1 and t.pad == 2  # the last entry: rows that do not move
    assert np.all(t.shift.numpy() == 0)


def test_drafting_graphs_through_prefix_hits_and_retraction(model) -> None:
    """The prompts twice on one engine (prefix hits), then KV memory for the longest request
    alone (retraction: a retracted request keeps its table slot, its head state written again
    by its prefill's observe): every token as without drafts, steps in graph each time, and
    every slot back at the end."""
    m, cfg, ops = model
    prompts = _prompts(cfg, 14)
    base = Engine(m, cfg, ops, EngineConfig(decode_graphs="off")).generate(prompts, GREEDY)
    k = 2
    eng = _engine(model, k, True, **STAGGERED)
    _same(base, eng.generate(prompts, GREEDY))
    hits, steps = eng.scheduler.prefix_stats()["hit_tokens"], eng.stats["drafting_graph_steps"]
    _same(base, eng.generate(prompts, GREEDY))
    assert eng.scheduler.prefix_stats()["hit_tokens"] > hits and eng.stats["drafting_graph_steps"] > steps
    lengths = [len(p) + GREEDY.max_tokens + 2 * k + 2 for p in prompts]  # (a verify row, one behind it)
    kv = retraction_budget(eng.groups, lengths, len(prompts))
    small = _engine(model, k, True, **RETRACTION, kv_cache_bytes=kv, max_batch_size=len(prompts))
    _same(base, small.generate(prompts, GREEDY))
    assert small.stats["retracted"] > 0 and small.stats["drafting_graph_steps"] > 0
    assert not small.drafting.table.slot


def test_an_abort_and_a_failed_step_in_graph_lose_no_block_or_slot(model) -> None:
    """A request aborted while its step in graph is in flight, then a step in graph that raises:
    the requests of the plans in flight end "abort" (the error with the failed ones), their
    head-table slots and KV blocks come back, and requests after that decode as without
    drafts, in graph."""
    m, cfg, ops = model
    prompts = _prompts(cfg, 15)
    base = Engine(m, cfg, ops, EngineConfig(decode_graphs="off")).generate(prompts, GREEDY)
    eng = _engine(model, 2, True)
    eng.scheduler.flush_prefix_cache()
    free = [eng.scheduler.free_blocks(g) for g in range(len(eng.groups))]
    slots = len(eng.drafting.table.free)
    ids = [eng.add(p, GREEDY) for p in prompts[:2]]
    while eng.stats["drafting_graph_steps"] < 2:
        eng.step()
    assert eng._inflight is not None and eng._inflight.verify.in_graph
    eng.abort(ids[0])
    run, calls = eng.drafting.graphs.run, []

    def failing(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected")
        return run(*a, **kw)

    eng.drafting.graphs.run = failing
    while eng.has_work():
        eng.step()
    assert eng.requests[ids[0]].finish_reason == "abort" and eng.requests[ids[0]].error is None
    assert eng.requests[ids[1]].finish_reason == "abort" and "injected" in eng.requests[ids[1]].error
    eng.drafting.graphs.run = run
    steps = eng.stats["drafting_graph_steps"]
    rest = [eng.add(p, GREEDY) for p in prompts[2:]]
    while eng.has_work():
        eng.step()
    _same(base[2:], [eng.release(i) for i in rest])
    assert eng.stats["drafting_graph_steps"] > steps
    eng.scheduler.flush_prefix_cache()
    assert [eng.scheduler.free_blocks(g) for g in range(len(eng.groups))] == free
    assert len(eng.drafting.table.free) == slots and not eng.drafting.table.slot


def test_drafting_graphs_run_to_the_maximum_model_length(model) -> None:
    """Requests to the maximum model length (16 tokens), 3 drafts a step in graph: a verify row
    reaches k past the limit and one planned behind it k + 1 more (the graphs' block tables are
    2k + 1 wider); no step fails and the tokens are a run's without drafts."""
    m, cfg, ops = model
    prompts = _prompts(cfg, 16)[:2]
    prompts[1] = prompts[1][:11]
    params = [SamplingParams(max_tokens=16 - len(p), temperature=0, ignore_eos=True) for p in prompts]
    fields = dict(block_size=4, max_model_len=16)
    base = Engine(m, cfg, ops, EngineConfig(decode_graphs="off", **fields)).generate(prompts, params)
    eng = _engine(model, 3, True, **fields)
    _same(base, eng.generate(prompts, params))
    assert eng.stats["failed_steps"] == 0 and eng.stats["drafting_graph_steps"] > 0
