"""The per-layer n-gram embedding (sdk/blocks/ngram.py) against the transformers module it
mirrors, qwen4_exp's Qwen4ExpTextPLELayer (hashed n-gram ids, the tables, the gated injection
into every hyper-connection stream, the dilated conv), on random weights and inputs, fp32 on CPU.

Checked, 2 seeds, tolerance 1e-5 absolute (outputs are O(1)): the hash tables (multipliers,
prime head sizes, offsets, padded rows) equal the reference's buffers; one whole 40-token
forward with eos tokens inside (documents end mid-request); the same tokens as a chunked
prefill (13 + 11) then one-token decode steps continuing the history and conv state in the
slot; one step mixing a decode row with a fresh prompt in another slot.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from dayzero.kernels.selection import OpTable
from dayzero.sdk.blocks.ngram import NgramCfg, NgramInjection, hash_tables, ngram_cache, ngram_needs
from dayzero.sdk.engine.context import StateMeta

TOL = 1e-5
SEEDS = (0, 1)
EOS = 7
CFG = NgramCfg(
    vocab=97, hidden=16, streams=3, dim=24, size=4, heads_per_order=2, vocab_base=50, divisible_by=8,
    seed=1234, index=1, parts=2, conv_kernel=3, eos=EOS, norm_eps=1e-6,
)  # fmt: skip


def _reference(seed: int) -> torch.nn.Module:
    from transformers import Qwen4ExpTextConfig
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextPLELayer

    c = CFG
    hf = Qwen4ExpTextConfig(
        vocab_size=c.vocab, hidden_size=c.hidden, hc_count=c.streams, num_hidden_layers=4,
        layer_types=["linear_attention"] * 4, ple_layer_ids=[1, 3], ple_embed_dim=c.dim,
        ngram_size=c.size, heads_per_ngram=c.heads_per_order, ngram_vocab_size_base=c.vocab_base,
        make_ngram_vocab_size_divisible_by=c.divisible_by, seed=c.seed, split_ngram_parts=c.parts,
        ple_conv_kernel_size=c.conv_kernel, eos_token_id=c.eos, rms_norm_eps=c.norm_eps,
    )  # fmt: skip
    ref = Qwen4ExpTextPLELayer(hf, layer_idx=2, ple_layer_index=c.index).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.startswith("norm_"):  # zero-centred: applied as 1 + w
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "ngram_embedding" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:  # projections and the conv (the reference initialises the conv to zeros)
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return ref


def _ours(ref: torch.nn.Module) -> NgramInjection:
    ops = OpTable(torch.device("cpu"), torch.float32)
    for op, features, head_dim in ngram_needs(CFG):
        ops.need(op, features, head_dim)
    ours = NgramInjection(CFG, ops.resolve(), (0, 256))
    with torch.no_grad():
        ours.table.copy_(ref.ple_embedding.ngram_embedding.weight.view(CFG.parts, -1, ours.table.shape[-1]))
        ours.key_proj.copy_(ref.key_proj.weight)
        ours.value_proj.copy_(ref.value_proj.weight)
        ours.norm_key.copy_(ref.norm_key.weight)
        ours.norm_query.copy_(ref.norm_query.weight)
        ours.norm_conv.copy_(ref.norm_conv.weight)
        ours.conv.copy_(ref.conv1d.weight)
    return ours


def _step(pool: torch.Tensor, ids: torch.Tensor, lengths, slots, has_init) -> SimpleNamespace:
    qs = [0]
    for n in lengths:
        qs.append(qs[-1] + n)
    return SimpleNamespace(input_ids=ids, state=StateMeta(pool, tuple(slots), tuple(has_init), tuple(qs)))


def _inputs(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + seed)
    ids = torch.randint(0, CFG.vocab, (n,), generator=g)
    ids[[i for i in (5, 6, 17, 30) if i < n]] = EOS  # documents end inside the request (twice in a row once)
    return ids, torch.randn(n, CFG.streams * CFG.hidden, generator=g)


def test_hash_tables_match_the_reference() -> None:
    ref = _reference(0).ple_embedding
    mults, sizes, offsets, rows = hash_tables(CFG)
    assert mults == ref.layer_multipliers.tolist()
    assert sizes == ref.ngram_heads_vocab_sizes.tolist() and offsets == ref.ngram_heads_offsets.tolist()
    assert rows == ref.ngram_embedding.weight.shape[0]
    assert ngram_cache(CFG)[0].row == 8 * (CFG.size - 1)


@pytest.mark.parametrize("seed", SEEDS)
def test_ngram_injection_matches_the_reference(seed: int) -> None:
    ref = _reference(seed)
    ours = _ours(ref)
    ids, x = _inputs(seed, 40)
    slot = sum(-(-d.row // 256) * 256 for d in ngram_cache(CFG))
    pool = torch.full((3, slot), 255, dtype=torch.uint8)  # garbage (NaN) in every slot

    def run(a: int, b: int, s: int, fresh: bool) -> torch.Tensor:
        xs = x[a:b].view(b - a, CFG.streams, CFG.hidden)
        return ours(xs, _step(pool, ids[a:b], [b - a], [s], [not fresh])).flatten(1)

    with torch.no_grad():
        want = x + ref(x[None], ids[None], None)[0]  # [T, N D]: the stream plus the injection
        assert (run(0, 40, 1, True) - want).abs().max().item() < TOL

        # chunked prefill (13 + 11 tokens), then 16 decode steps, continuing slot 2
        cut = [0, 13, 24, *range(25, 41)]
        got = [run(a, b, 2, i == 0) for i, (a, b) in enumerate(itertools.pairwise(cut))]
        assert (torch.cat(got) - want).abs().max().item() < TOL

        # one step: a decode row continuing slot 2 (a 9-token prompt) next to a fresh prompt in slot 0
        pids, px = _inputs(seed + 50, 12)
        first = run(0, 9, 2, True)
        both = torch.cat((x[9:10], px)).view(13, CFG.streams, CFG.hidden)
        step = _step(pool, torch.cat((ids[9:10], pids)), [1, 12], [2, 0], [True, False])
        mixed = ours(both, step).flatten(1)
        assert (torch.cat((first, mixed[:1])) - want[:10]).abs().max().item() < TOL
        assert (mixed[1:] - (px + ref(px[None], pids[None], None)[0])).abs().max().item() < TOL


@pytest.mark.parametrize("seed", SEEDS)
def test_batched_decode_steps_equal_the_reference(seed: int) -> None:
    """The graph-safe decode step of kernels/batched/ngram.py (ngram_ids, dilated_conv: device
    slots and fresh flags only) against the reference's row loop, on one decode step of 4 rows in
    scattered slots: one fresh over a slot of garbage, one with an eos in its history, one whose
    token is an eos; 3-grams with 2 heads an order and 4-grams with 3; dilation 1 and 3. Ids equal,
    conv outputs and states within 1e-6, every other slot unchanged."""
    from dayzero.kernels.batched import ngram as batched
    from dayzero.kernels.reference import ngram as reference

    g = torch.Generator().manual_seed(seed)
    slots, fresh, eos, vocab = [5, 0, 7, 2], [False, True, False, False], 2, 50
    meta = StateMeta(
        None, tuple(slots), tuple(not f for f in fresh), tuple(range(5)),
        slots=torch.tensor(slots), fresh=torch.tensor(fresh, dtype=torch.int64), decode=True,
    )  # fmt: skip
    for n, hg in ((3, 2), (4, 3)):
        ids = torch.randint(3, vocab, (4,), generator=g)
        ids[3] = eos
        history = torch.randint(3, vocab, (9, n - 1), generator=g)
        history[7, 0] = eos  # row 2: a document boundary in its history
        mult = torch.randint(1, 1000, (n,), generator=g) * 2 + 1
        sizes = torch.randint(50, 90, ((n - 1) * hg,), generator=g)
        offs = torch.cumsum(sizes, 0) - sizes
        h_ref, h_got = history.clone(), history.clone()
        want = reference.ngram_ids(ids, h_ref, mult, sizes, offs, hg, eos, meta)
        got = batched.ngram_ids(ids, h_got, mult, sizes, offs, hg, eos, meta)
        assert torch.equal(got, want) and torch.equal(h_got, h_ref), (n, got, want)
    for k, d in ((3, 1), (2, 3), (4, 3)):
        x, w = torch.randn(4, 6, generator=g), torch.randn(6, 1, k, generator=g)
        state = torch.randn(9, 6, (k - 1) * d, generator=g)
        state[0] = float("nan")  # the fresh row's slot is not read
        s_ref, s_got = state.clone(), state.clone()
        want = reference.dilated_conv(x, w, d, s_ref, meta)
        got = batched.dilated_conv(x, w, d, s_got, meta)
        assert (got - want).abs().max().item() < 1e-6, (k, d)
        assert torch.allclose(s_got[slots], s_ref[slots], atol=1e-6)
        unused = [i for i in range(9) if i not in slots]
        assert torch.equal(s_got[unused], state[unused]) and torch.equal(s_ref[unused], state[unused])


@pytest.mark.parametrize("seed", SEEDS)
def test_a_verify_step_keeps_the_ngram_state_after_each_token(seed: int) -> None:
    """Rows of 3 tokens in one decode step (StateMeta.steps, checkpoints; a speculative verify
    step), batched ngram_ids and dilated_conv: each token's result, and the state in its
    checkpoint slot, equal 3 single-token decode steps run in turn (ids and histories equal,
    conv within 1e-6); the rows' own slots are only read. An eos among the tokens."""
    from dataclasses import replace

    from dayzero.kernels.batched import ngram as batched

    g = torch.Generator().manual_seed(seed)
    steps, slots, fresh, eos, vocab = 3, [4, 0, 2], [True, False, False], 2, 50
    ckpt = torch.arange(5, 14).view(3, steps)

    def one(fresh_rows):
        return StateMeta(
            None, tuple(slots), tuple(not f for f in fresh_rows), tuple(range(4)),
            slots=torch.tensor(slots), fresh=torch.tensor(fresh_rows, dtype=torch.int64), decode=True,
        )  # fmt: skip

    verify = replace(one(fresh), steps=steps, checkpoints=ckpt)
    n, hg = 4, 3
    ids = torch.randint(3, vocab, (9,), generator=g)
    ids[4] = eos  # row 1's second token
    history = torch.randint(3, vocab, (14, n - 1), generator=g)
    mult = torch.randint(1, 1000, (n,), generator=g) * 2 + 1
    sizes = torch.randint(50, 90, ((n - 1) * hg,), generator=g)
    offs = torch.cumsum(sizes, 0) - sizes
    got_h, seq_h = history.clone(), history.clone()
    got = batched.ngram_ids(ids, got_h, mult, sizes, offs, hg, eos, verify)
    assert torch.equal(got_h[slots], history[slots])
    for t in range(steps):
        want = batched.ngram_ids(
            ids[t::steps], seq_h, mult, sizes, offs, hg, eos, one(fresh if t == 0 else [False] * 3)
        )
        assert torch.equal(got[t::steps], want) and torch.equal(got_h[ckpt[:, t]], seq_h[slots]), t
    k, d = 3, 2
    x, w = torch.randn(9, 6, generator=g), torch.randn(6, 1, k, generator=g)
    state = torch.randn(14, 6, (k - 1) * d, generator=g)
    state[4] = float("nan")  # the fresh row's slot is not read
    got_s, seq_s = state.clone(), state.clone()
    got = batched.dilated_conv(x, w, d, got_s, verify)
    assert torch.equal(got_s[slots].nan_to_num(), state[slots].nan_to_num())
    for t in range(steps):
        want = batched.dilated_conv(x[t::steps], w, d, seq_s, one(fresh if t == 0 else [False] * 3))
        assert (got[t::steps] - want).abs().max().item() < 1e-6, t
        assert (got_s[ckpt[:, t]] - seq_s[slots]).abs().max().item() < 1e-6, t


def test_the_table_splits_by_rows_over_ranks() -> None:
    """Tensor parallel: each rank holds its runs of every checkpoint part's rows (its `shards`
    slice of the whole table) and looks up only the ids there; the ranks' lookups (here summed
    by hand: the ranks' all-reduce) equal the whole table's, at 2, 3 and 4 ranks, on ids over the
    whole table; 5 ranks (276 rows a part) are refused by name."""
    from dataclasses import replace

    from dayzero.sdk.config.model import Parallel

    ops = OpTable(torch.device("cpu"), torch.float32)
    for op, features, head_dim in ngram_needs(CFG):
        ops.need(op, features, head_dim)
    ops = ops.resolve()
    g = torch.Generator().manual_seed(SEEDS[0])
    whole = NgramInjection(CFG, ops, (0, 256))
    with torch.no_grad():
        whole.table.copy_(torch.randn(whole.table.shape, generator=g))
    ids = torch.randint(0, whole.table.shape[0] * whole.table.shape[1], (9, CFG.heads), generator=g)
    want = whole._lookup(ids)  # [T, Hn, E / Hn]
    for size in (2, 3, 4):
        total = torch.zeros_like(want)
        for rank in range(size):
            cfg = replace(CFG, par=Parallel(size, rank))
            part = NgramInjection(cfg, ops, (0, 256))
            (cut,) = NgramInjection.shards(cfg)["table"].values()
            with torch.no_grad():
                part.table.copy_(whole.table.narrow(cut.dim, cut.start, cut.length))
            total += part._lookup(ids)  # the one-rank group's all-reduce leaves the rank's share
        assert torch.equal(total, want), size
    refused = r"n-gram table rows of a part \(276\) does not split over .* size 5"
    with pytest.raises(ValueError, match=refused):
        NgramInjection(replace(CFG, par=Parallel(5, 0)), ops, (0, 256))
