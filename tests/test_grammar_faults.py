"""A grammar beside min_tokens, and a request that fails after its step (issue 14).

A JSON schema {"type": "boolean"} with min_tokens 50: once "true" / "false" is out the grammar
allows only EOS, which min_tokens bans; before the fix every logit of the row was -inf, token 0
was drawn, the grammar rejected it after the scheduler had been fed, and every later step failed
the same way while the requests beside it lost their tokens. Now the grammar wins (the request
ends "stop" with valid JSON), and a failure in one request's bookkeeping after its step (a
matcher that raises, injected) aborts that request alone, with the error. Engine level on a tiny
Llama (its byte-level BPE tokenizer feeds xgrammar), overlap off and on, greedy and sampled with
the recorded seeds; the samplers (reference, batched) on their own; and the real server with the
openai client. Tolerances: the innocent request's tokens equal its solo run's exactly, its
logprobs within 1e-5 (one batch against another on the CPU)."""

from __future__ import annotations

import json
import types
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from conftest import SEEDS
from server_fixture import Server

from dayzero.kernels.batched.sampling import sample as batched_sample
from dayzero.kernels.reference.sampling import sample as reference_sample
from dayzero.sdk.api import LLM
from dayzero.sdk.engine.engine import EngineConfig, SamplingParams
from dayzero.sdk.engine.sampling import Sampler, only_among
from dayzero.sdk.parity.tiny import write_tiny

pytest.importorskip("xgrammar")

BOOLEAN = {"type": "boolean"}
INNOCENT = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PROMPT = [5, 6, 7, 8, 9, 10]
SAMPLERS = {"reference": reference_sample, "batched": batched_sample}


def _words(allowed: torch.Tensor) -> torch.Tensor:
    """[S, V] bool -> the [S, ceil(V / 32)] int32 bitmask."""
    s, v = allowed.shape
    bits = torch.zeros(s, (v + 31) // 32 * 32, dtype=torch.int64)
    bits[:, :v] = allowed.long()
    words = (bits.view(s, -1, 32) << torch.arange(32)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def test_only_among_reads_the_bitmask() -> None:
    v = 70  # the last word is partly past the vocabulary
    allowed = torch.zeros(1, v, dtype=torch.bool)
    allowed[0, [2, 31, 69]] = True
    words = _words(allowed)[0]
    assert only_among(words, (2, 31, 69), v) and only_among(words, (2, 31, 69, 5), v)
    assert not only_among(words, (2, 31), v) and not only_among(words, (), v)
    full = torch.full((3,), -1, dtype=torch.int32)  # an unconstrained row (bits past V set too)
    assert not only_among(full, (2,), v)
    assert only_among(_words(torch.zeros(1, v, dtype=torch.bool))[0], (), v)  # nothing allowed


@pytest.mark.parametrize("backend", sorted(SAMPLERS))
@pytest.mark.parametrize("seed", SEEDS)
def test_a_grammar_that_can_only_end_outranks_min_tokens(seed: int, backend: str) -> None:
    """Rows 0-1: the grammar allows only EOS (2), min_tokens bans it: EOS is drawn, greedy and
    sampled. Rows 2-3: the grammar allows EOS and two more tokens: the ban holds. Row 4: a grammar
    that allows nothing (no valid token exists): the reference's draw no longer raises; both
    samplers give the argmax, token 0, which the engine's grammar check then refuses."""
    v, eos = 100, 2
    g = torch.Generator().manual_seed(seed)
    sampler = Sampler(types.SimpleNamespace(sample=SAMPLERS[backend]), torch.device("cpu"), v)
    temps = [0.0, 1.0, 0.0, 0.7, 1.0]
    params = [
        SamplingParams(max_tokens=60, min_tokens=50, temperature=t, seed=seed + i)
        for i, t in enumerate(temps)
    ]
    allowed = torch.zeros(len(params), v, dtype=torch.bool)
    allowed[:2, eos] = True
    allowed[2:4, [eos, 40, 77]] = True
    gens = [torch.Generator().manual_seed(p.seed) for p in params]
    logits = 3 * torch.randn(len(params), v, generator=g)
    logits[:, eos] += 20  # EOS is by far the likeliest wherever it is allowed
    rids = list(range(len(params)))
    stops = [(eos,)] * len(params)
    pending = sampler.launch(logits, params, gens, rids, [3] * len(params), stops, _words(allowed))
    tokens = pending.result()[0].tolist()
    assert tokens[:2] == [eos, eos]
    assert tokens[2] in (40, 77) and tokens[3] in (40, 77)
    assert tokens[4] == 0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny("llama", tmp_path_factory.mktemp("llama") / "ckpt", seed=6)


def _llm(path, overlap: str) -> LLM:
    cfg = EngineConfig(block_size=4, kv_cache_bytes=4 << 20, max_batch_size=4, overlap=overlap)
    return LLM(path, device="cpu", progress=False, engine=cfg)


def _same(got, want) -> None:
    assert got.error is None and got.finish_reason == want.finish_reason
    assert got.token_ids == want.token_ids
    assert max(abs(x - y) for x, y in zip(got.logprobs, want.logprobs, strict=True)) < 1e-5


def _all_blocks_back(eng, free: int) -> None:
    while eng.has_work():
        eng.step()
    assert not eng.params and not eng.matchers and len(eng.sampler.state) == 0
    assert eng.scheduler.plans_in_flight == 0
    eng.scheduler.check_invariants()
    eng.scheduler.flush_prefix_cache()
    assert eng.scheduler.free_blocks(0) == free


def _beside_innocent(llm: LLM, prompt: list[int], constrained: SamplingParams):
    """(the constrained request's output, the innocent one's, the constrained text) of the two
    run together to their ends, no step failing."""
    eng = llm.engine
    a = eng.add(prompt, constrained)
    b = eng.add(PROMPT, INNOCENT)
    while not (eng.requests[a].finished and eng.requests[b].finished):
        eng.step()
        assert eng.failures == 0
    eng._drain()
    got_a, got_b = eng.release(a), eng.release(b)
    return got_a, got_b, llm.tokenizer.decode(got_a.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_boolean_schema_with_min_tokens_beside_an_innocent_request(checkpoint, overlap: str) -> None:
    llm = _llm(checkpoint, overlap)
    eng = llm.engine
    free = eng.scheduler.free_blocks(0)
    (want,) = eng.generate([PROMPT], INNOCENT)  # the innocent request alone
    asked = llm.encode("Is the sky blue? Answer true or false.")
    runs = [(0.0, None), *((1.0, s) for s in SEEDS)]
    for temperature, seed in runs:
        constrained = SamplingParams(
            max_tokens=60,
            min_tokens=50,
            temperature=temperature,
            seed=seed,
            grammar=llm.grammars.json(BOOLEAN),
        )
        got_a, got_b, text = _beside_innocent(llm, asked, constrained)
        assert json.loads(text) in (True, False), (temperature, seed, text)
        assert got_a.finish_reason == "stop" and got_a.error is None, got_a
        assert got_a.token_ids[-1] in eng.cfg.eos_token_ids  # ended by the grammar, before min_tokens
        assert len(got_a.token_ids) < constrained.min_tokens
        _same(got_b, want)
    assert eng.stats["failed_steps"] == 0 and eng.stats["failed_requests"] == 0
    _all_blocks_back(eng, free)


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_a_failure_after_the_step_aborts_only_its_request(checkpoint, overlap: str) -> None:
    """A matcher whose accept raises for one request at its 4th token (injected): that request
    ends "abort" with the error and the tokens it had; the two beside it (one constrained, one
    not) finish as they do alone; no step failed; every block comes back."""
    llm = _llm(checkpoint, overlap)
    eng = llm.engine
    free = eng.scheduler.free_blocks(0)
    grammar = llm.grammars.json(BOOLEAN)
    json_params = SamplingParams(max_tokens=10, temperature=0, grammar=grammar)
    (want_b,) = eng.generate([PROMPT], INNOCENT)
    (want_c,) = eng.generate([[3, 4]], json_params)
    victim = eng.add([11, 12, 13], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    b = eng.add(PROMPT, INNOCENT)
    c = eng.add([3, 4], json_params)
    accept, seen = eng.matchers.accept, []

    def faulty(rid: int, token: int) -> None:
        if rid == victim:
            seen.append(token)
            if len(seen) == 4:
                raise RuntimeError("injected fault in accept")
        accept(rid, token)

    eng.matchers.accept = faulty
    while not all(eng.requests[i].finished for i in (victim, b, c)):
        eng.step()
        assert eng.failures == 0
    eng._drain()
    out = eng.release(victim)
    assert out.finish_reason == "abort" and "injected fault in accept" in out.error, out
    assert out.token_ids == seen  # the failing token is recorded, nothing after it
    _same(eng.release(b), want_b)
    _same(eng.release(c), want_c)
    assert eng.stats["failed_steps"] == 0 and eng.stats["failed_requests"] == 1
    _all_blocks_back(eng, free)


def test_the_server_answers_both_requests(checkpoint) -> None:
    """Through `dayzero serve` and the openai client: the boolean schema with min_tokens 50 next
    to a greedy request; the constrained answer parses, the innocent one equals its solo run,
    nothing failed, no block is held afterwards."""
    srv = Server(str(checkpoint), "--max-num-seqs", "4")
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    innocent = dict(model=model, prompt="the quick brown fox", max_tokens=32, temperature=0)
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": BOOLEAN}}
    msgs = [{"role": "user", "content": "Is the sky blue? Answer true or false."}]
    try:
        alone = client.completions.create(**innocent).choices[0]
        assert alone.text
        with ThreadPoolExecutor(2) as pool:
            for seed in (None, *SEEDS[:2]):
                inn = pool.submit(client.completions.create, **innocent)
                con = pool.submit(
                    client.chat.completions.create, model=model, messages=msgs, max_tokens=60,
                    temperature=0 if seed is None else 1.0, seed=seed, response_format=fmt,
                    extra_body={"min_tokens": 50},
                )  # fmt: skip
                got, c = inn.result().choices[0], con.result().choices[0]
                assert got.text == alone.text and got.finish_reason == alone.finish_reason
                assert json.loads(c.message.content) in (True, False) and c.finish_reason == "stop", c
        assert srv.metric("dayzero_requests_running") == 0
        text = httpx.get(f"{srv.url}/metrics", timeout=10).text
        used = sum(
            float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith("dayzero_kv_blocks_used{")
        )
        assert used == srv.metric("dayzero_prefix_cache_blocks")  # no request holds a block
        health = httpx.get(f"{srv.url}/health", timeout=10)
        assert health.status_code == 200, health.text
    finally:
        srv.stop()


ENUM = {"enum": ["red", "green", "blue"]}


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_a_complete_grammar_ends_its_request_under_ignore_eos(checkpoint, overlap: str) -> None:
    """ignore_eos beside a grammar: once the grammar has accepted its end (EOS, the only token
    it allows after a complete value) the request finishes "stop" there, as vLLM's does; before,
    ignore_eos left EOS out of the request's stops and it ran on unconstrained to max_tokens.
    Greedy and sampled with the recorded seeds, two schemas, beside an innocent request that
    equals its solo run; every block comes back."""
    llm = _llm(checkpoint, overlap)
    eng = llm.engine
    free = eng.scheduler.free_blocks(0)
    (want,) = eng.generate([PROMPT], INNOCENT)
    asked = llm.encode("Is the sky blue? Answer true or false.")
    for schema, allowed in ((BOOLEAN, (True, False)), (ENUM, tuple(ENUM["enum"]))):
        for temperature, seed in [(0.0, None), *((1.0, s) for s in SEEDS)]:
            constrained = SamplingParams(
                max_tokens=40, temperature=temperature, seed=seed, ignore_eos=True,
                grammar=llm.grammars.json(schema),
            )  # fmt: skip
            got_a, got_b, text = _beside_innocent(llm, asked, constrained)
            assert json.loads(text) in allowed, (schema, temperature, seed, text)
            assert got_a.finish_reason == "stop" and got_a.error is None, got_a
            assert got_a.token_ids[-1] in eng.cfg.eos_token_ids  # the grammar's end, then nothing
            assert len(got_a.token_ids) < constrained.max_tokens
            _same(got_b, want)
    assert eng.stats["failed_steps"] == 0 and eng.stats["failed_requests"] == 0
    _all_blocks_back(eng, free)


@pytest.mark.parametrize("constrained", [False, True])
@pytest.mark.parametrize("overlap", ["off", "on"])
def test_a_request_failed_after_its_step_is_reported_in_that_step(
    checkpoint, overlap: str, constrained: bool
) -> None:
    """The step whose collect fails one request (an injected fault in its grammar check) returns
    it finished ("abort", the error, the failing token last), not the step after; released
    there, as the server does, it is never reported again (the scheduler's later report of it is
    passed over) and the steps after it run clean. A constrained victim fails at its first token:
    under overlap the next plan, made before that collect, still holds a row of it (sampled and
    dropped). The request beside it equals its solo run; every block comes back."""
    llm = _llm(checkpoint, overlap)
    eng = llm.engine
    free = eng.scheduler.free_blocks(0)
    (want_b,) = eng.generate([PROMPT], INNOCENT)
    fail_at = 1 if constrained else 4
    grammar = llm.grammars.json({"type": "array", "items": {"type": "integer"}}) if constrained else None
    for seed in SEEDS:
        victim = eng.add(
            [11, 12, 13, seed % 50 + 20],
            SamplingParams(max_tokens=20, temperature=1.0, seed=seed, ignore_eos=True, grammar=grammar),
        )
        b = eng.add(PROMPT, INNOCENT)
        accept, seen, fired = eng.matchers.accept, [], []

        def faulty(rid: int, token: int, victim=victim, accept=accept, seen=seen, fired=fired) -> None:
            if rid == victim:
                seen.append(token)
                if len(seen) == fail_at:
                    fired.append(True)
                    raise RuntimeError("injected fault in accept")
            accept(rid, token)

        eng.matchers.accept = faulty
        reported = 0
        while not eng.requests[b].finished:
            outs = {o.id: o for o in eng.step()}
            assert eng.failures == 0
            if victim in outs:
                out = outs[victim]
                if fired and reported == 0:
                    assert out.finished, "the failed request is not reported finished in its step"
                    assert out.finish_reason == "abort" and "injected fault" in out.error, out
                    assert out.token_ids == seen  # the failing token is recorded, nothing after it
                    eng.release(victim)
                    reported += 1
                else:
                    assert not out.finished and not fired  # never reported twice
        del eng.matchers.accept  # the instance attribute: the class's own method again
        assert reported == 1 and victim not in eng.requests
        eng._drain()
        _same(eng.release(b), want_b)
        assert not eng._reported  # the scheduler's report of the victim came and was passed over
    assert eng.stats["failed_steps"] == 0 and eng.stats["failed_requests"] == len(SEEDS)
    _all_blocks_back(eng, free)


def test_the_server_ends_a_complete_grammar_under_ignore_eos(checkpoint) -> None:
    """Through `dayzero serve` and the openai client: response_format with ignore_eos (vLLM's
    extra field) answers the schema's value and finishes "stop" before max_tokens, greedy and
    sampled, streamed and not; no block is held afterwards."""
    srv = Server(str(checkpoint), "--max-num-seqs", "4")
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": BOOLEAN}}
    msgs = [{"role": "user", "content": "Is the sky blue? Answer true or false."}]
    try:
        for seed in (None, *SEEDS):
            kw = dict(
                model=model, messages=msgs, max_tokens=48, temperature=0 if seed is None else 1.0,
                seed=seed, response_format=fmt, extra_body={"ignore_eos": True},
            )  # fmt: skip
            got = client.chat.completions.create(**kw)
            c = got.choices[0]
            assert json.loads(c.message.content) in (True, False) and c.finish_reason == "stop", c
            assert got.usage.completion_tokens < 48, got.usage
            parts, finish = [], None
            for chunk in client.chat.completions.create(**kw, stream=True):
                for ch in chunk.choices:
                    parts.append(ch.delta.content or "")
                    finish = ch.finish_reason or finish
            assert "".join(parts) == c.message.content and finish == "stop"  # same seed, same answer
        assert srv.metric("dayzero_requests_running") == 0
        text = httpx.get(f"{srv.url}/metrics", timeout=10).text
        used = sum(
            float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith("dayzero_kv_blocks_used{")
        )
        assert used == srv.metric("dayzero_prefix_cache_blocks")
    finally:
        srv.stop()
