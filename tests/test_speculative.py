"""Speculative decoding (sdk/engine/speculative.py) on tiny random checkpoints, fp32 on CPU.

Lossless: with any drafter (the target's own continuation, right for the first j drafts only,
always wrong, prompt lookup) greedy tokens equal a run without drafts and logprobs agree within
parity's fp32 1e-4 (the same logits computed in other batch shapes; measured up to 1.1e-5),
through chunked prefill,
prefix hits and retraction, stop tokens and max_tokens inside a step's accepted drafts. Sampled:
the tokens of 1,600 seeded requests (top-k 4, so 64 joint outcomes of three tokens) against the
exact distribution the model gives, by a chi-square test at p = 0.001 (recorded seeds: the
outcome is fixed, not flaky). Every attention kind and recurrent state the launch families have
(FAMILIES): a rejected draft's state is rolled back (the greedy checks compare every token).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch

from dayzero.sdk.engine.drafters import SpeculativeConfig, TokenDrafter
from dayzero.sdk.engine.engine import Engine, EngineConfig, SamplingParams
from dayzero.sdk.engine.memory import checkpoint_slots
from dayzero.sdk.engine.speculative import accepted
from dayzero.sdk.loader import open_checkpoint
from dayzero.sdk.parity.criteria import Tolerance
from dayzero.sdk.parity.runner import RETRACTION, Ours, retraction_budget
from dayzero.sdk.parity.tiny import write_tiny

K = 3
LOGPROB_TOL = Tolerance().logprobs  # parity's fp32 bound; measured here at most 1.1e-5 (qwen38)
GREEDY = SamplingParams(max_tokens=13, temperature=0, ignore_eos=True)


# GQA; MLA + DSA; KDA + NoPE MLA + KPool + hyper-connections; Gated DeltaNet; Gated DeltaNet +
# QSA + n-gram embeddings + low-rank hyper-connections; KDA + gated MLA + attention residuals
FAMILIES = ["llama", "glm53", "glm53_flash", "qwen38", "qwen38_flash_next", "kimi_k3"]


@pytest.fixture(scope="module", params=FAMILIES)
def model(request, tmp_path_factory) -> Ours:
    folder = tmp_path_factory.mktemp(request.param)
    return Ours(
        open_checkpoint(write_tiny(request.param, folder, seed=3)), torch.device("cpu"), torch.float32
    )


def _prompts(ours: Ours, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    vocab = ours.cfg.embedding.vocab
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (3, 11, 26, 40)]


class Oracle:
    """Drafts from known continuations: the first `right` of each step's drafts are the target's
    own next tokens, the rest one off (wrong); none once a request left every known one."""

    def __init__(self, prompts: list[list[int]], outs, right: int = K) -> None:
        self.full = [p + o.token_ids for p, o in zip(prompts, outs, strict=True)]
        self.right = right

    def __call__(self, tokens: list[int], k: int) -> list[int]:
        full = next((f for f in self.full if f[: len(tokens)] == tokens), [])
        nxt = full[len(tokens) : len(tokens) + k]
        return [t if i < self.right else t + 1 for i, t in enumerate(nxt)]


def _engine(ours: Ours, drafter=None, **kw):
    eng = ours.engine(**({"decode_graphs": "off"} | kw), speculative=SpeculativeConfig("ngram", K))
    if drafter is not None:
        eng.drafter = TokenDrafter(drafter)
    return eng


def _same(base, spec) -> None:
    for b, s in zip(base, spec, strict=True):
        assert s.token_ids == b.token_ids and s.finish_reason == b.finish_reason
        assert max(abs(x - y) for x, y in zip(b.logprobs, s.logprobs, strict=True)) < LOGPROB_TOL


@pytest.mark.parametrize("right", [K, 1, 0, None], ids=["oracle", "first-right", "wrong", "ngram"])
def test_greedy_with_drafts_equals_greedy_without(model: Ours, right: int | None) -> None:
    prompts = _prompts(model, 1)
    base = model.engine(decode_graphs="off").generate(prompts, GREEDY)
    eng = _engine(model, None if right is None else Oracle(prompts, base, right))
    _same(base, eng.generate(prompts, GREEDY))
    s = eng.stats
    assert s["verify_rows"] > 0 and s["drafted"] == K * s["verify_rows"]
    if right is not None:  # each drafted row accepts min(right, what is left) drafts
        assert s["accepted_at"][right:] == [0] * (K - right) and all(a > 0 for a in s["accepted_at"][:right])
        assert all(a <= s["verify_rows"] for a in s["accepted_at"])
    if right == K:  # 12 decode tokens a request: 3 steps of 4
        assert s["verify_rows"] == 3 * len(prompts)


def test_chunks_prefix_hits_and_retraction_with_drafts(model: Ours) -> None:
    """Chunks of 8 on blocks of 4 and the prompts twice (prefix hits); then KV memory for the
    longest request alone (retraction; parity's chunks and blocks): the same tokens as one roomy
    engine without drafts."""
    prompts = _prompts(model, 2)
    base = model.engine(decode_graphs="off").generate(prompts, GREEDY)
    eng = _engine(model, Oracle(prompts, base, 2), block_size=4, chunk_size=8, max_tokens_per_step=24)
    _same(base, eng.generate(prompts, GREEDY))
    hits = eng.scheduler.prefix_stats()["hit_tokens"]
    _same(base, eng.generate(prompts, GREEDY))
    assert eng.scheduler.prefix_stats()["hit_tokens"] > hits and eng.stats["accepted_at"][0] > 0
    lengths = [len(p) + GREEDY.max_tokens + K for p in prompts]
    kv = retraction_budget(eng.groups, lengths, len(prompts))
    small = _engine(
        model, Oracle(prompts, base, 2), **RETRACTION, kv_cache_bytes=kv, max_batch_size=len(prompts)
    )
    _same(base, small.generate(prompts, GREEDY))
    assert small.stats["retracted"] > 0


def test_verify_steps_run_in_the_decode_graph_buffers(model: Ours) -> None:
    """decode_graphs "buffers" (the CUDA graphs' static buffers, run eagerly): a model without
    recurrent state verifies a step with no prefill row as single-token rows (speculative.flat_plan),
    with the tokens and logprobs of the varlen pass, through chunks and prefix hits; a model with
    recurrent state (KDA, Gated DeltaNet, convolutions, n-gram history) too, each request's k + 1
    tokens a state row whose state after each token is kept in a checkpoint slot (the kept one
    copied back)."""
    prompts = _prompts(model, 4)
    base = model.engine(decode_graphs="off").generate(prompts, GREEDY)
    eng = _engine(model, Oracle(prompts, base, 2), decode_graphs="buffers", block_size=4, chunk_size=8)
    _same(base, eng.generate(prompts, GREEDY))
    _same(base, eng.generate(prompts, GREEDY))  # prefix hits
    assert eng.stats["graph_steps"] > 0
    assert (eng.pool.checkpoints > 0) == (eng.pool.state_bytes > 0)
    assert eng.stats["accepted_at"][1] > 0
    every = _engine(model, Oracle(prompts, base), decode_graphs="buffers")  # rows keep all k + 1 tokens
    _same(base, every.generate(prompts, GREEDY))
    assert every.stats["accepted_at"][K - 1] > 0


def test_stops_and_max_tokens_inside_accepted_drafts(model: Ours) -> None:
    """A stop token among a step's accepted drafts ends the request there ("stop"), and
    max_tokens cuts a step's tokens ("length"), as without drafts."""
    prompts = _prompts(model, 3)
    long = model.engine(decode_graphs="off").generate(prompts, GREEDY)
    stops = [SamplingParams(max_tokens=13, temperature=0, stop_token_ids=[o.token_ids[5]]) for o in long]
    lengths = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for params in (stops, lengths):
        base = model.engine(decode_graphs="off").generate(prompts, params)
        _same(base, _engine(model, Oracle(prompts, long)).generate(prompts, params))
    assert {o.finish_reason for o in base} == {"length"}


def test_requests_whose_sampling_reads_their_tokens_decode_without_drafts(model: Ours) -> None:
    """A repetition penalty reads the request's earlier tokens: its rows verify no drafts (the
    same tokens as without), beside a greedy request that does."""
    prompts = _prompts(model, 4)[:2]
    params = [SamplingParams(max_tokens=9, temperature=0, repetition_penalty=1.3, ignore_eos=True), GREEDY]
    base = model.engine(decode_graphs="off").generate(prompts, params)
    eng = _engine(model, Oracle(prompts, base))
    _same(base, eng.generate(prompts, params))
    assert eng.stats["verify_rows"] == 3  # the greedy request's 12 tokens, 4 a step


@pytest.mark.parametrize("model", ["llama", "qwen38"], indirect=True)
def test_sampling_with_drafts_keeps_the_target_distribution(model: Ours) -> None:
    """1,600 requests (seeds 0..1599), three tokens each at temperature 1 with top-k 4, drafts
    the greedy continuation: the joint frequencies of the three tokens against the exact
    probabilities the model gives (its logits at every prefix, with the same top-k), chi-square
    over the outcomes (those expected fewer than 5 times pooled)."""
    prompt = _prompts(model, 5)[1]
    n, top = 1600, 4
    params = [
        SamplingParams(max_tokens=3, temperature=1.0, top_k=top, seed=s, ignore_eos=True) for s in range(n)
    ]
    greedy = model.engine(decode_graphs="off").generate([prompt], SamplingParams(max_tokens=4, temperature=0))
    eng = _engine(model, Oracle([prompt], greedy), max_batch_size=64)
    outs = eng.generate([prompt] * n, params)
    assert eng.stats["accepted_at"][0] > 0  # both paths: accepted drafts and rejections
    seen = Counter(tuple(o.token_ids) for o in outs)

    def probs(prefixes: list[list[int]]) -> list[dict[int, float]]:
        logits = model.prefill_logits(prefixes)
        out = []
        for lg in logits:
            v, i = lg[-1].double().topk(top)
            out.append(dict(zip(i.tolist(), torch.softmax(v, 0).tolist(), strict=True)))
        return out

    (p1,) = probs([prompt])
    p2 = dict(zip(p1, probs([[*prompt, a] for a in p1]), strict=True))
    pairs = [(a, b) for a in p1 for b in p2[a]]
    p3 = dict(zip(pairs, probs([prompt + list(ab) for ab in pairs]), strict=True))
    exact = {(a, b, c): p1[a] * p2[a][b] * p3[(a, b)][c] for (a, b) in pairs for c in p3[(a, b)]}
    assert set(seen) <= set(exact) and abs(sum(exact.values()) - 1) < 1e-9
    big = [o for o in exact if exact[o] * n >= 5]
    small = [o for o in exact if o not in big]
    obs = [seen[o] for o in big] + [sum(seen[o] for o in small)]
    exp = [exact[o] * n for o in big] + [sum(exact[o] for o in small) * n]
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    chi2 = sum((o - e) ** 2 / e for o, e in zip(obs, exp, strict=True))
    p = torch.special.gammaincc(torch.tensor((len(obs) - 1) / 2), torch.tensor(chi2 / 2)).item()
    assert p > 1e-3, (chi2, len(obs), p)


def test_accepted_counts_leading_matches() -> None:
    assert accepted([5, 6, 7], [5, 6, 7, 8]) == 3
    assert accepted([5, 6, 7], [5, 9, 7, 8]) == 1
    assert accepted([5, 6, 7], [4, 6, 7, 8]) == 0
    assert accepted([5, 6], [5]) == 0  # a row sampled at one position only


def test_the_ngram_drafter_proposes_what_followed_the_last_match() -> None:
    propose = SpeculativeConfig("ngram", 3, prompt_lookup_max=3).drafter().propose
    assert propose([1, 2, 3, 4, 9, 2, 3], 3) == [4, 9, 2]  # "2 3" matched, the latest occurrence
    assert propose([7, 1, 7, 2, 7], 2) == [2, 7]
    assert propose([1, 2, 3], 3) == []


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (
            '{"method": "eagle", "num_speculative_tokens": 2}',
            r"unknown speculative method 'eagle'; known: mtp, ngram",
        ),
        ('{"method": "ngram", "num_speculative_tokens": 0}', r"num_speculative_tokens must be in \[1, 16\]"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "draft_tp": 2}', r"unknown key\(s\) draft_tp"),
        ('{"method": "ngram"}', r"needs 'method' and 'num_speculative_tokens'"),
        ("{method", r"Expecting property name"),
    ],
)
def test_bad_speculative_configs_are_refused_by_name(value: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.parse(value)


def test_oracle_covers_every_acceptance_length() -> None:
    """The oracle's drafts for 'first j right' confirm exactly j (the test drafter's own check)."""
    prompts = [[1, 2]]

    class Out:
        def __init__(self) -> None:
            self.token_ids = [3, 4, 5, 6]

    for j in range(K + 1):
        drafts = Oracle(prompts, [Out()], j)([1, 2], K)
        assert accepted(drafts, [3, 4, 5, 6]) == j


def test_the_verify_checkpoints_come_out_of_the_kv_budget(tmp_path) -> None:
    """A stateful model drafting with decode graphs keeps k + 1 state checkpoints a batch row
    (KvPool.checkpoints) inside kv_cache_bytes: fewer KV pages than without them. Where half the
    budget holds fewer requests' checkpoints than the batch, the verify graphs take that many
    requests and larger verify steps run varlen (the same tokens); where it holds none, no graph."""
    ours = Ours(open_checkpoint(write_tiny("qwen38", tmp_path, seed=3)), torch.device("cpu"), torch.float32)
    spec = SpeculativeConfig("ngram", K)
    cfg = EngineConfig(max_batch_size=4, kv_cache_bytes=4 << 20, decode_graphs="buffers", speculative=spec)
    assert checkpoint_slots(ours.cfg, cfg, torch.device("cpu")) == 4 * (K + 1)
    assert checkpoint_slots(ours.cfg, replace(cfg, decode_graphs="auto"), torch.device("cpu")) == 0
    drafting = Engine(ours.model, ours.cfg, ours.ops, cfg)
    plain = Engine(ours.model, ours.cfg, ours.ops, replace(cfg, decode_graphs="off"))
    assert drafting.pool.checkpoints == 4 * (K + 1) and plain.pool.checkpoints == 0
    assert drafting.pool.layout["num_pages"] < plain.pool.layout["num_pages"]
    slot = drafting.pool.layout["state_slot_bytes"]
    prompts = _prompts(ours, 6)
    base = ours.engine(decode_graphs="off").generate(prompts, GREEDY)
    two = Engine(ours.model, ours.cfg, ours.ops, replace(cfg, kv_cache_bytes=5 * slot * (K + 1)))
    assert two.pool.checkpoints == 2 * (K + 1) and two.graphs.sizes[-1] == 2 * (K + 1)
    two.drafter = TokenDrafter(Oracle(prompts, base, 2))
    _same(base, two.generate(prompts, GREEDY))
    assert two.stats["graph_steps"] > 0 and two.stats["accepted_at"][1] > 0
    none = replace(cfg, max_batch_size=1, kv_cache_bytes=6 * slot)  # half: 3 slots; a request needs K + 1
    assert checkpoint_slots(ours.cfg, none, torch.device("cpu")) == 0
    assert Engine(ours.model, ours.cfg, ours.ops, none).graphs is None
