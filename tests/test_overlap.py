"""The engine's overlap (EngineConfig.overlap): step N+1 is planned and launched before step N's
tokens are read back, a decode row's input token filled in on the device from the step before.
On the CPU the device work is synchronous, so what these tests check is the bookkeeping: the
same requests give the same tokens and logprobs (1e-4, fp32: a request whose last prefill chunk
is in flight waits a step, so rows batch differently and sums run in another order) with overlap
on and off, through
the plain path and the decode buffers, with EOS stops, length limits, seeded sampling, requests
joining mid-run, aborts while a step is in flight, and prompt_logits after it; no KV block is
left running and no plan in flight once everything has finished."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import SEEDS

from dayzero.sdk.api import LLM
from dayzero.sdk.engine.context import PinnedRing
from dayzero.sdk.engine.engine import EngineConfig, SamplingParams
from dayzero.sdk.parity.tiny import write_tiny

LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module", params=["llama", "beam", "glm53_flash"])
def checkpoint(request, tmp_path_factory):
    return write_tiny(request.param, tmp_path_factory.mktemp(request.param) / "ckpt", seed=4)


def _engine(path, overlap: str, graphs: str = "off"):
    cfg = EngineConfig(
        block_size=4, kv_cache_bytes=4 << 20, max_batch_size=6, decode_graphs=graphs, overlap=overlap
    )
    return LLM(path, device="cpu", progress=False, engine=cfg).engine


def _same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids, (x.id, x.token_ids, y.token_ids)
        assert x.finish_reason == y.finish_reason
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs, strict=True)) < LOGPROB_TOL


@pytest.mark.parametrize("seed", SEEDS[:2])
def test_overlap_gives_the_tokens_of_the_synchronous_loop(checkpoint, seed: int) -> None:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, 100, n).tolist() for n in (3, 9, 17, 6, 25, 11)]
    params = [
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=4, temperature=0),  # may stop at EOS
        SamplingParams(max_tokens=9, temperature=0.9, top_k=20, seed=seed),
        SamplingParams(max_tokens=15, temperature=1.2, top_p=0.8, min_p=0.05, seed=seed + 1),
        SamplingParams(max_tokens=1, temperature=0),
        SamplingParams(max_tokens=7, temperature=0, stop_token_ids=(7, 42), top_logprobs=3),
    ]
    outs = {}
    for graphs in ("off", "buffers"):
        for overlap in ("off", "on"):
            eng = _engine(checkpoint, overlap, graphs)
            outs[graphs, overlap] = eng.generate(prompts, params)
            while eng.has_work():  # the step launched with the last tokens is still to be fed
                eng.step()
            assert eng.scheduler.num_running == 0 and eng.scheduler.plans_in_flight == 0
            eng.scheduler.check_invariants()
            assert (eng.stats["device_inputs"] > 0) == (overlap == "on")
    ref = outs["off", "off"]
    for key, got in outs.items():
        _same(got, ref)
        assert [len(o.top_logprobs) for o in got] == [len(o.top_logprobs) for o in ref], key


def test_requests_joining_and_aborted_while_a_step_is_in_flight(checkpoint) -> None:
    """A request added between steps joins the next plan; one aborted between steps gives no
    token past the abort (its in-flight token is dropped) and finishes 'abort'."""
    runs = {}
    for overlap in ("off", "on"):
        eng = _engine(checkpoint, overlap)
        greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
        a = eng.add([5, 6, 7, 8], greedy)
        b = eng.add([9, 10, 11], greedy)
        for _ in range(4):
            eng.step()
        c = eng.add([12, 13, 14, 15, 16], greedy)
        eng.abort(b)
        aborted_at = len(eng.requests[b].token_ids)
        while eng.has_work():
            eng.step()
        assert eng.requests[b].finish_reason == "abort"
        assert len(eng.requests[b].token_ids) <= aborted_at + (1 if overlap == "on" else 0)
        runs[overlap] = [eng.release(i) for i in (a, c)]
    _same(runs["on"], runs["off"])


def test_prompt_logits_after_an_overlapped_run(checkpoint) -> None:
    """generate() leaves the engine idle (the step in flight fed), so prompt_logits can follow."""
    eng = _engine(checkpoint, "on")
    eng.generate([[3, 4, 5]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert not eng.has_work()
    want = _engine(checkpoint, "off").prompt_logits([[7, 8, 9, 10]])[0]
    got = eng.prompt_logits([[7, 8, 9, 10]])[0]
    assert (got - want).abs().max().item() < 1e-5


def test_overlap_mode_is_checked() -> None:
    with pytest.raises(ValueError, match="overlap 'yes'; known: auto, on, off"):
        EngineConfig(overlap="yes")


def test_penalties_see_the_token_still_on_the_device(checkpoint) -> None:
    """Penalties count every output token, also the one the previous step sampled that only the
    device holds yet (overlap): the same tokens with overlap on and off, greedy and sampled."""
    prompts = [[5, 6, 7, 8, 9], [11, 3, 3, 3], [20, 21], [4, 4, 4, 4, 4, 4]]
    params = [
        SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, frequency_penalty=1.5),
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, repetition_penalty=1.8),
        SamplingParams(max_tokens=10, temperature=0.9, seed=3, presence_penalty=1.0, logit_bias={9: 2.0}),
        SamplingParams(
            max_tokens=9, temperature=0, stop_token_ids=(17,), min_tokens=5, logit_bias={17: 50.0}
        ),
    ]
    outs = {o: _engine(checkpoint, o).generate(prompts, params) for o in ("off", "on")}
    _same(outs["on"], outs["off"])
    last = outs["off"][3].token_ids
    assert len(last) == 6 and last[-1] == 17 and 17 not in last[:5]  # min_tokens held the stop back
    assert len(set(outs["off"][0].token_ids)) > 3  # the frequency penalty keeps it from repeating


def test_the_pinned_ring_waits_for_a_half_before_writing_it_again(monkeypatch) -> None:
    """context.PinnedRing (CUDA uploads through one pinned buffer, here unpinned on the CPU with
    stand-in events): each upload gives its values; leaving a half records an event, and
    re-entering a half waits for the event recorded when it was left (its copies done); an
    upload larger than a quarter of a half takes a copy of its own."""
    events = []

    class Event:
        def __init__(self) -> None:
            self.waited = False
            events.append(self)

        def record(self, stream=None) -> None:
            return None

        def synchronize(self) -> None:
            self.waited = True

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    ring = PinnedRing(torch.device("cpu"), nbytes=1024, pin=False)  # halves of 512 bytes
    rng = np.random.default_rng(SEEDS[0])
    for i in range(16):  # 96 bytes each: 5 a half, so halves 0, 1, 0, 1 from uploads 1, 6, 11, 16
        want = torch.from_numpy(rng.integers(0, 1 << 40, 12))
        assert torch.equal(ring.upload(want).clone(), want), i
    assert [e.waited for e in events] == [True, True, False]
    assert (ring.h, ring.at) == (1, 96)
    big = torch.from_numpy(rng.integers(0, 1 << 40, 20))  # 160 bytes > 512 / 4
    assert torch.equal(ring.upload(big), big) and (ring.h, ring.at) == (1, 96)
