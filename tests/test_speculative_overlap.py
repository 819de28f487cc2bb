"""Drafting steps with overlap (sdk/engine/speculative.py): step N+1 is planned and launched
before step N's tokens are read back, its rows placed as if N kept every draft; the device moves
each back by the drafts N rejected (positions, KV lengths, new-token slots) and gives it y_a as
its first input, and the MTP head observes N from the sampled tokens on the device. Where that
cannot be (host drafts, recurrent state, a step outside the graphs' buffers) the step waits for
N's readback and moves its rows on the host.

Lossless, fp32 on CPU: greedy tokens and logprobs equal a run without drafts (parity's fp32
logprob bound). A device oracle (the target's own continuation, right for the first j drafts:
every acceptance length 0..k) drafts on the device from the row's moved position, so a wrong
move gives wrong drafts and a wrong token; the MTP heads (random weights) of the stateless
families (a Llama with a head folder; GLM-5.3's NextN over MLA + DSA) draft with the same tokens
as without overlap; the stateful families (KDA, Gated DeltaNet) wait, moving rows on the host;
also through chunks, prefix hits and retraction.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from test_mtp import KITS, _ours
from test_mtp_head import _head
from test_speculative import LOGPROB_TOL, Oracle

from dayzero.sdk.engine.drafters import SpeculativeConfig, TokenDrafter
from dayzero.sdk.engine.engine import Engine, EngineConfig, SamplingParams
from dayzero.sdk.engine.speculative import Behind, DeviceDrafts
from dayzero.sdk.families import build
from dayzero.sdk.loader import load_weights, open_checkpoint, open_mtp_head
from dayzero.sdk.parity.runner import RETRACTION, retraction_budget
from dayzero.sdk.parity.tiny import write_tiny

K = 3
GREEDY = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)


class DeviceOracle:
    """A drafter on the device, as the MTP head is: each drafted row's drafts are its request's
    known continuation at the row's position as the device has it (the plan's, less the `Behind`
    shift), the first `right` of them right and the rest one off."""

    hidden = True

    def __init__(self, prompts: list[list[int]], outs, right: int) -> None:
        full = [p + o.token_ids for p, o in zip(prompts, outs, strict=True)]
        width = max(map(len, full)) + 2 * K + 2
        self.seq = torch.tensor([f + [0] * (width - len(f)) for f in full])  # [N, width]
        self.index = {tuple(p): i for i, p in enumerate(prompts)}
        self.right = right

    def draft(self, engine, plan, rows: list[int], k: int, behind: Behind | None = None) -> DeviceDrafts:
        qs, dev = np.asarray(plan.query_start), engine.device
        req = [self.index[tuple(engine.requests[int(plan.req_ids[r])].prompt_ids)] for r in rows]
        at = torch.from_numpy(np.asarray(plan.positions, dtype=np.int64)[qs[rows]]).to(dev)  # x_p, planned
        if behind is not None:
            at = at - behind.shift[torch.tensor(rows, device=dev)]
        cols = (at[:, None] + torch.arange(1, k + 1, device=dev)).clamp(max=self.seq.shape[1] - 1)
        drafts = self.seq.to(dev)[torch.tensor(req, device=dev)[:, None], cols]  # [R', k]
        drafts[:, self.right :] += 1
        out = DeviceDrafts(list(rows), drafts)
        out.copy_to_host()
        return out

    def observe(self, engine, plan, verify, kept=None) -> None:  # (its drafts need no head)
        assert verify.sampled is not None and (verify.a is not None) == (kept is None)

    def drop(self, rid: int) -> None:
        return None


def _llama_with_head(tmp: Path):
    base = write_tiny("llama", tmp / "base", seed=3)
    _head(tmp / "head", base, 3)
    ckpt = open_checkpoint(base)
    head = open_mtp_head(tmp / "head", ckpt)
    cfg = ckpt.family.config(head.hf, str(base), mtp=True)
    model, ops = build(ckpt.family, cfg, head.hf, torch.device("cpu"), torch.float32)
    load_weights(model, ckpt, progress=False, head=head)
    return model, cfg, ops


def built(name: str, tmp_path_factory):
    """(model, config, ops) of a tiny family checkpoint with an MTP head (llama: a head folder)."""
    tmp = tmp_path_factory.mktemp(name)
    if name == "llama":
        return _llama_with_head(tmp)
    return _ours(name, KITS[name](tmp, 0).path)[:3]


@pytest.fixture(scope="module", params=["llama", "glm53", "kimi_k3", "qwen38"])
def model(request, tmp_path_factory):
    return built(request.param, tmp_path_factory)


def _prompts(cfg, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, cfg.embedding.vocab, (n,), generator=g).tolist() for n in (3, 11, 26, 40)]


def _same(base, outs, tol: float = LOGPROB_TOL) -> None:
    for b, s in zip(base, outs, strict=True):
        assert s.token_ids == b.token_ids and s.finish_reason == b.finish_reason
        assert max(abs(x - y) for x, y in zip(b.logprobs, s.logprobs, strict=True)) < tol


def _drafts_by_request(engine: Engine) -> dict[int, list[list[int]]]:
    """Each request's drafts, step by step, as each step verified them (read back with its
    tokens: drafted pass by pass or in a drafting graph)."""
    seen: dict[int, list[list[int]]] = {}
    inner = engine._collect

    def collect(done):
        out = inner(done)
        v = done.verify
        if v is not None and v.device is not None:
            for r in v.device.rows:
                seen.setdefault(int(done.req_ids[r]), []).append(v.drafts[r])
        return out

    engine._collect = collect
    return seen


def _stateful(engine: Engine) -> bool:
    return engine.pool.state_bytes > 0


@pytest.mark.parametrize("right", [K, 1, 0])
def test_rows_moved_on_the_device_decode_as_without_drafts(model, right: int) -> None:
    """A device oracle right for the first `right` drafts, overlap on, the graphs' buffers: the
    tokens of a run without drafts; every acceptance length below `right` + 1 seen; stateless
    models move their rows on the device, stateful ones on the host."""
    m, cfg, ops = model
    prompts = _prompts(cfg, 1)
    base = Engine(m, cfg, ops, EngineConfig(decode_graphs="off")).generate(prompts, GREEDY)
    config = EngineConfig(decode_graphs="buffers", overlap="on", speculative=SpeculativeConfig("mtp", K))
    eng = Engine(m, cfg, ops, config)
    eng.drafter = DeviceOracle(prompts, base, right)
    _same(base, eng.generate(prompts, GREEDY))
    s = eng.stats
    assert s["verify_rows"] > 0 and s["accepted_at"][right:] == [0] * (K - right)
    assert all(a > 0 for a in s["accepted_at"][:right])
    host, device = s["rows_moved_on_host"], s["rows_moved_on_device"]
    assert (host > 0, device > 0) == ((True, False) if _stateful(eng) else (False, True)), (host, device)


def test_stops_and_rows_without_drafts_with_overlap(model) -> None:
    """Overlap on, the device oracle (every draft right): a request whose stop token falls inside
    a step's accepted drafts ends there (its row planned behind that step is dropped), and a
    request with a presence penalty (its sampling reads its tokens: no drafts, a row that keeps
    one token) decodes beside the drafting ones; each as in a run without drafts."""
    m, cfg, ops = model
    prompts = _prompts(cfg, 5)
    free = Engine(m, cfg, ops, EngineConfig(decode_graphs="off")).generate(prompts[:1], GREEDY)
    stop = SamplingParams(max_tokens=14, temperature=0, stop_token_ids=[free[0].token_ids[6]])
    penalty = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, presence_penalty=0.7)
    params = [stop, penalty, GREEDY, GREEDY]
    base = Engine(m, cfg, ops, EngineConfig(decode_graphs="off")).generate(prompts, params)
    assert base[0].finish_reason == "stop" and len(base[0].token_ids) <= 7
    config = EngineConfig(decode_graphs="buffers", overlap="on", speculative=SpeculativeConfig("mtp", K))
    eng = Engine(m, cfg, ops, config)
    eng.drafter = DeviceOracle(prompts, base, K)
    _same(base, eng.generate(prompts, params))
    assert eng.stats["accepted_at"][K - 1] > 0


def test_the_mtp_head_drafts_the_same_with_overlap(model) -> None:
    """The model's MTP head (2 drafts; random weights, so mostly rejected): overlap on gives the
    tokens of a run without drafts and the very drafts of a run without overlap, in the graphs'
    buffers and eagerly (where every step waits: no buffers to move rows in); with overlap a
    request's last row, planned before its end was read back, drafts once more."""
    m, cfg, ops = model
    prompts = _prompts(cfg, 2)
    base = Engine(m, cfg, ops, EngineConfig(decode_graphs="off")).generate(prompts, GREEDY)
    spec = SpeculativeConfig("mtp", 2)
    seen = {}
    for graphs in ("buffers", "off"):
        for overlap in ("on", "off"):
            eng = Engine(m, cfg, ops, EngineConfig(decode_graphs=graphs, overlap=overlap, speculative=spec))
            seen[graphs, overlap] = _drafts_by_request(eng)
            _same(base, eng.generate(prompts, GREEDY))
            moved = eng.stats["rows_moved_on_device"] + eng.stats["rows_moved_on_host"]
            assert (moved > 0) == (overlap == "on")
            if graphs == "off":
                assert eng.stats["rows_moved_on_device"] == 0
    on, off = seen["buffers", "on"], seen["buffers", "off"]
    assert sorted(on) == sorted(off) == list(range(len(prompts)))
    for rid, drafts in off.items():
        assert on[rid][: len(drafts)] == drafts and len(on[rid]) - len(drafts) in (0, 1) and len(drafts) > 2


def test_overlap_through_chunks_prefix_hits_and_retraction(model) -> None:
    """Overlap on with the device oracle (right for the first 2 of 3): chunks of 8 on blocks of 4
    (steps mixing a prefill chunk wait and move their rows on the host), the prompts twice
    (prefix hits), then KV memory for the longest request alone (retraction; a stateful model
    without the graphs' buffers)."""
    m, cfg, ops = model
    prompts = _prompts(cfg, 3)
    base = Engine(m, cfg, ops, EngineConfig(decode_graphs="off")).generate(prompts, GREEDY)
    spec = SpeculativeConfig("mtp", K)
    fields = dict(decode_graphs="buffers", overlap="on", speculative=spec, block_size=4)
    eng = Engine(m, cfg, ops, EngineConfig(**fields, chunk_size=8, max_tokens_per_step=24))
    eng.drafter = DeviceOracle(prompts, base, 2)
    _same(base, eng.generate(prompts, GREEDY))
    hits = eng.scheduler.prefix_stats()["hit_tokens"]
    _same(base, eng.generate(prompts, GREEDY))
    assert eng.scheduler.prefix_stats()["hit_tokens"] > hits
    assert eng.stats["rows_moved_on_host"] > 0  # the steps with a prefill chunk
    lengths = [len(p) + GREEDY.max_tokens + 2 * K + 2 for p in prompts]
    kv = retraction_budget(eng.groups, lengths, len(prompts))
    # (a stateful model's verify graphs would take half this budget for their state checkpoints)
    graphs = "off" if _stateful(eng) else "buffers"
    small_fields = dict(fields, **RETRACTION, kv_cache_bytes=kv, max_batch_size=len(prompts))
    small = Engine(m, cfg, ops, EngineConfig(**(small_fields | {"decode_graphs": graphs})))
    small.drafter = DeviceOracle(prompts, base, 2)
    _same(base, small.generate(prompts, GREEDY))
    assert small.stats["retracted"] > 0


def test_host_drafts_wait_for_the_step_in_flight(model) -> None:
    """Prompt lookup's drafts read the request's tokens on the host: with overlap on, a step
    behind a verify row waits for it, moves its rows on the host and drafts from the tokens."""
    m, cfg, ops = model
    prompts = _prompts(cfg, 4)
    base = Engine(m, cfg, ops, EngineConfig(decode_graphs="off")).generate(prompts, GREEDY)
    config = EngineConfig(decode_graphs="buffers", overlap="on", speculative=SpeculativeConfig("ngram", K))
    eng = Engine(m, cfg, ops, config)
    eng.drafter = TokenDrafter(Oracle(prompts, base, 1))
    _same(base, eng.generate(prompts, GREEDY))
    assert eng.stats["rows_moved_on_host"] > 0 and eng.stats["rows_moved_on_device"] == 0
    assert eng.stats["accepted_at"][0] > 0


def test_overlap_with_drafts_is_refused_on_several_ranks_by_name(model) -> None:
    m, cfg, ops = model
    two = replace(cfg, parallel=replace(cfg.parallel, size=2))
    with pytest.raises(ValueError, match="without overlap on 2 ranks"):
        Engine(m, two, ops, EngineConfig(overlap="on", speculative=SpeculativeConfig("mtp", K)))


def test_aborts_and_a_failed_step_with_overlap_lose_no_blocks(model) -> None:
    """Overlap on, the device oracle: a request aborted while its row is in flight (and another
    planned behind it) ends "abort"; a step whose forward raises aborts the requests of the two
    plans in flight, with the error; the requests after it decode as without drafts; every KV
    block is back once the engine idles."""
    m, cfg, ops = model
    prompts = _prompts(cfg, 6)
    base = Engine(m, cfg, ops, EngineConfig(decode_graphs="off")).generate(prompts, GREEDY)
    config = EngineConfig(decode_graphs="buffers", overlap="on", speculative=SpeculativeConfig("mtp", K))
    eng = Engine(m, cfg, ops, config)
    eng.drafter = DeviceOracle(prompts, base, 1)
    eng.scheduler.flush_prefix_cache()
    free = [eng.scheduler.free_blocks(g) for g in range(len(eng.groups))]
    ids = [eng.add(p, GREEDY) for p in prompts[:2]]
    for _ in range(4):
        eng.step()
    assert eng._inflight is not None
    eng.abort(ids[0])
    run, calls = eng.graphs.run, []

    def failing(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected")
        return run(*a, **kw)

    eng.graphs.run = failing
    while eng.has_work():
        eng.step()
    assert eng.requests[ids[0]].finish_reason == "abort" and eng.requests[ids[0]].error is None
    assert eng.requests[ids[1]].finish_reason == "abort" and "injected" in eng.requests[ids[1]].error
    eng.graphs.run = run
    rest = [eng.add(p, GREEDY) for p in prompts[2:]]
    while eng.has_work():
        eng.step()
    _same(base[2:], [eng.release(i) for i in rest])
    eng.scheduler.flush_prefix_cache()
    assert [eng.scheduler.free_blocks(g) for g in range(len(eng.groups))] == free


@pytest.mark.parametrize("overlap", ["on", "off"])
def test_requests_run_to_the_maximum_model_length(model, overlap: str) -> None:
    """A request to the maximum model length: its last verify rows reach k past it, a row
    planned behind them k + 1 more (the graphs' block tables are that much wider); its tokens
    are a run's without drafts."""
    m, cfg, ops = model
    prompts = _prompts(cfg, 7)[:2]
    params = [SamplingParams(max_tokens=16 - len(p), temperature=0, ignore_eos=True) for p in prompts[:1]]
    params.append(SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    prompts[1] = prompts[1][:11]
    fields = dict(block_size=4, max_model_len=16)
    base = Engine(m, cfg, ops, EngineConfig(decode_graphs="off", **fields)).generate(prompts, params)
    spec = SpeculativeConfig("mtp", K)
    eng = Engine(
        m, cfg, ops, EngineConfig(decode_graphs="buffers", overlap=overlap, speculative=spec, **fields)
    )
    eng.drafter = DeviceOracle(prompts, base, 1)
    _same(base, eng.generate(prompts, params))
    assert eng.stats["failed_steps"] == 0 and eng.stats["graph_steps"] > 0
