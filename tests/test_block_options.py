"""Block options of issue 17 against the transformers modules they mirror (tiny random modules
built from transformers' classes, seeded): q/k norm over all heads (OLMo2) and zero-centred
(Gemma3), zero-centred RMSNorm and the scaled embedding (Gemma3), the gated activations (GeGLU:
Gemma3's MLP; the clamped form with its limit, router bias and expert biases: gpt-oss's MoE),
attention sinks (gpt-oss); the batched kernels against the reference ops with the same options.
fp32 throughout, tolerance TOL of the output's scale (the same numbers summed in another order);
the embedding and the norms in bf16 are compared exactly (the same roundings)."""

from __future__ import annotations

import pytest
import torch
from conftest import SEEDS
from one_row import context
from paged_meta import paged_meta

from dayzero.kernels.batched.attention import gqa_attention as batched_attention
from dayzero.kernels.batched.moe import moe_experts as batched_experts
from dayzero.kernels.reference.attention import gqa_attention as reference_attention
from dayzero.kernels.reference.moe import moe_experts as reference_experts
from dayzero.kernels.selection import OpTable
from dayzero.sdk.blocks.base import BLOCKS
from dayzero.sdk.blocks.norm import Embedding, RMSNorm
from dayzero.sdk.config.model import CacheGroupCfg, EmbeddingCfg, NormCfg

CPU = torch.device("cpu")
TOL = 2e-6


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def _block(kind: str, opts: dict, symbols: dict):
    """(module, resolved config) of one block from spec options and symbol values, its kernels
    selected on the CPU; parameters random until copied from the reference."""
    bdef = BLOCKS.get(kind)
    o = bdef.options.model_validate({"kind": kind} | opts)

    def val(v):
        return symbols[v[1:]] if isinstance(v, str) and v.startswith("$") else v

    cfg = bdef.resolve(o, val)
    ops = OpTable(CPU, torch.float32)
    for op, features, head_dim in bdef.needs(cfg):
        ops.need(op, features, head_dim)
    ops = ops.resolve()
    if bdef.role == "attention":
        return bdef.module(cfg, ops, ((0, 0),)), cfg
    return bdef.module(cfg, ops), cfg


def _attn_symbols(c, weight_in_fp32: bool = True) -> dict:
    return {
        "hidden": c.hidden_size,
        "norm_eps": c.rms_norm_eps,
        "norm_weight_in_fp32": weight_in_fp32,
        "max_position": c.max_position_embeddings,
    }


def _run_attention(block, cfg, x: torch.Tensor) -> torch.Tensor:
    t = x.shape[0]
    ctx = context(t, [CacheGroupCfg("kv", "paged", None, 2 * cfg.kv_heads * cfg.head_dim, (0,))])
    return block(x, ctx)


def _causal(t: int, window: int | None = None) -> torch.Tensor:
    i = torch.arange(t)
    ok = i[None, :] <= i[:, None]
    if window is not None:
        ok &= i[None, :] > i[:, None] - window
    return torch.where(ok, 0.0, float("-inf"))[None, None]  # [1, 1, T, T] additive


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _qkvo(block, ref) -> None:
    with torch.no_grad():
        block.in_proj.copy_(torch.cat([ref.q_proj.weight, ref.k_proj.weight, ref.v_proj.weight]))
        block.o_proj.copy_(ref.o_proj.weight)


@pytest.mark.parametrize("seed", SEEDS[:2])
def test_qk_norm_over_all_heads_matches_olmo2_attention(seed: int) -> None:
    from transformers import Olmo2Config
    from transformers.models.olmo2.modeling_olmo2 import Olmo2Attention, Olmo2RotaryEmbedding

    torch.manual_seed(seed)
    c = Olmo2Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    c._attn_implementation = "eager"
    ref = Olmo2Attention(c, 0).eval()
    with torch.no_grad():
        ref.q_norm.weight.uniform_(0.5, 1.5)
        ref.k_norm.weight.uniform_(0.5, 1.5)
    block, cfg = _block(
        "gqa",
        {"heads": 4, "kv_heads": 2, "head_dim": 8, "qk_norm": {"enabled": "$on", "over": "all"},
         "rope": {"theta": c.rope_parameters["rope_theta"]}},
        _attn_symbols(c) | {"on": True},
    )  # fmt: skip
    assert block.q_norm.shape == (32,) and block.k_norm.shape == (16,)
    _qkvo(block, ref)
    with torch.no_grad():
        block.q_norm.copy_(ref.q_norm.weight)
        block.k_norm.copy_(ref.k_norm.weight)
    t = 11
    x = torch.randn(t, 32)
    cos, sin = Olmo2RotaryEmbedding(c)(x[None], torch.arange(t)[None])
    want = ref(x[None], (cos, sin), _causal(t))[0][0]
    assert _rel(_run_attention(block, cfg, x), want) < TOL


@pytest.mark.parametrize("seed", SEEDS[:2])
@pytest.mark.parametrize("layer", ["full_attention", "sliding_attention"])
def test_zero_centred_qk_norm_matches_gemma3_attention(seed: int, layer: str) -> None:
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3Attention, Gemma3RotaryEmbedding

    torch.manual_seed(seed)
    c = Gemma3TextConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=16,
        sliding_window=4, layer_types=[layer], num_hidden_layers=1, max_position_embeddings=64,
    )  # fmt: skip
    c._attn_implementation = "eager"
    ref = Gemma3Attention(c, 0).eval()
    with torch.no_grad():
        ref.q_norm.weight.normal_(0, 0.5)
        ref.k_norm.weight.normal_(0, 0.5)
    window = 4 if layer == "sliding_attention" else None
    theta = c.rope_parameters[layer]["rope_theta"]
    block, cfg = _block(
        "gqa",
        {"heads": 4, "kv_heads": 2, "head_dim": 8, "qk_norm": {"zero_centred": True},
         "rope": {"theta": theta}, "scale": 16**-0.5, "window": window},
        _attn_symbols(c),
    )  # fmt: skip
    _qkvo(block, ref)
    with torch.no_grad():
        block.q_norm.copy_(ref.q_norm.weight)
        block.k_norm.copy_(ref.k_norm.weight)
    t = 10
    x = torch.randn(t, 32)
    cos, sin = Gemma3RotaryEmbedding(c)(x[None], torch.arange(t)[None], layer)
    want = ref(x[None], (cos, sin), _causal(t, window))[0][0]
    assert _rel(_run_attention(block, cfg, x), want) < TOL


@pytest.mark.parametrize("seed", SEEDS[:2])
@pytest.mark.parametrize("layer", ["full_attention", "sliding_attention"])
def test_sinks_match_gpt_oss_attention(seed: int, layer: str) -> None:
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention, GptOssRotaryEmbedding

    torch.manual_seed(seed)
    c = GptOssConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
        layer_types=[layer], num_hidden_layers=1, max_position_embeddings=64, attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 150000.0},
    )  # fmt: skip
    c._attn_implementation = "eager"
    ref = GptOssAttention(c, 0).eval()
    with torch.no_grad():
        ref.sinks.normal_(0, 2.0)
    window = 4 if layer == "sliding_attention" else None
    block, cfg = _block(
        "gqa",
        {"heads": 4, "kv_heads": 2, "head_dim": 8, "bias": True, "sinks": "$sinks",
         "rope": {"theta": 150000.0}, "window": window},
        _attn_symbols(c, False) | {"sinks": True},
    )  # fmt: skip
    _qkvo(block, ref)
    with torch.no_grad():
        block.qkv_bias.copy_(torch.cat([ref.q_proj.bias, ref.k_proj.bias, ref.v_proj.bias]))
        block.o_bias.copy_(ref.o_proj.bias)
        block.sinks.copy_(ref.sinks)
    t = 10
    x = torch.randn(t, 32)
    cos, sin = GptOssRotaryEmbedding(c)(x[None], torch.arange(t)[None])
    want = ref(x[None], (cos, sin), _causal(t, window))[0][0]
    assert _rel(_run_attention(block, cfg, x), want) < TOL


@pytest.mark.parametrize("seed", SEEDS[:2])
def test_batched_attention_with_sinks_equals_the_reference(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    h, hk, d, bs = 6, 2, 16, 4
    rows = [(1, 13), (7, 9), (5, 5), (1, 1)]  # decode, a chunk, a fresh prompt, a first token
    meta, blocks = paged_meta(rows, bs, g)
    q = torch.randn(sum(n for n, _ in rows), h, d, generator=g)
    kc, vc = torch.randn(blocks * bs, hk, d, generator=g), torch.randn(blocks * bs, hk, d, generator=g)
    sinks = torch.randn(h, generator=g) * 2
    for window, cap in ((None, None), (3, 2.0)):
        meta.memo.clear()
        want = reference_attention(q, kc, vc, meta, 0.3, window, cap, sinks)
        assert _rel(batched_attention(q, kc, vc, meta, 0.3, window, cap, sinks), want) < TOL
    decode = [(1, 13), (1, 6)]
    meta, blocks = paged_meta(decode, bs, g)
    q = torch.randn(2, h, d, generator=g)
    kc, vc = torch.randn(blocks * bs, hk, d, generator=g), torch.randn(blocks * bs, hk, d, generator=g)
    want = reference_attention(q, kc, vc, meta, 0.3, None, None, sinks)
    assert _rel(batched_attention(q, kc, vc, meta, 0.3, None, None, sinks), want) < TOL


def _gpt_oss_moe(seed: int):
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    torch.manual_seed(seed)
    c = GptOssConfig(
        hidden_size=32, intermediate_size=24, num_local_experts=8, num_experts_per_tok=2, swiglu_limit=1.5
    )
    c._experts_implementation = "eager"
    ref = GptOssMLP(c).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.3)
    return c, ref


def _copy_gpt_oss_experts(block, ref) -> None:
    """gpt-oss stores gate_up [E, Dm, 2I] with gate / up interleaved along 2I, down [E, I, Dm]."""
    ex = ref.experts
    with torch.no_grad():
        block.router.copy_(ref.router.weight)
        block.router_bias.copy_(ref.router.bias)
        w = ex.gate_up_proj.transpose(1, 2)  # [E, 2I, Dm]
        block.gate_up.copy_(torch.cat([w[:, 0::2], w[:, 1::2]], dim=1))
        b = ex.gate_up_proj_bias
        block.gate_up_bias.copy_(torch.cat([b[:, 0::2], b[:, 1::2]], dim=1))
        block.down.copy_(ex.down_proj.transpose(1, 2))
        block.down_bias.copy_(ex.down_proj_bias)


@pytest.mark.parametrize("seed", SEEDS[:2])
def test_clamped_experts_router_and_expert_biases_match_gpt_oss_mlp(seed: int) -> None:
    c, ref = _gpt_oss_moe(seed)
    block, _ = _block(
        "moe",
        {"experts": 8, "top_k": 2, "intermediate": 24, "limit": "$limit", "activation": "clamped_swiglu",
         "alpha": "$alpha", "router_bias": True, "expert_bias": True},
        {"hidden": 32, "limit": c.swiglu_limit, "alpha": c.swiglu_alpha},
    )  # fmt: skip
    _copy_gpt_oss_experts(block, ref)
    x = torch.randn(9, 32)
    want = ref(x[None])[0][0]
    assert _rel(block(x), want) < TOL


@pytest.mark.parametrize("seed", SEEDS[:2])
def test_batched_experts_with_biases_equal_the_reference(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    e, i, dm, t, k = 6, 16, 24, 5, 3  # 15 pairs: the gathered path
    x = torch.randn(t, dm, generator=g)
    gu, down = torch.randn(e, 2 * i, dm, generator=g) * 0.3, torch.randn(e, dm, i, generator=g) * 0.3
    gub, db = torch.randn(e, 2 * i, generator=g), torch.randn(e, dm, generator=g)
    ids = torch.rand(t, e, generator=g).topk(k, dim=-1).indices
    w = torch.rand(t, k, generator=g)
    acts = (("silu", (0.0, 0.0)), ("gelu_pytorch_tanh", (0.0, 0.0)), ("clamped_swiglu", (1.702, 0.0)))
    for act, consts in (*acts, ("situ", (4.0, 25.0)), ("situ", (2.0, 0.0))):
        args = (x, gu, down, w, ids, False, 2.0, act, consts, gub, db)
        assert _rel(batched_experts(*args), reference_experts(*args)) < TOL


@pytest.mark.parametrize("seed", SEEDS[:2])
def test_geglu_matches_gemma3_mlp(seed: int) -> None:
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3MLP

    torch.manual_seed(seed)
    c = Gemma3TextConfig(hidden_size=32, intermediate_size=48)
    ref = Gemma3MLP(c).eval()
    block, cfg = _block(
        "swiglu", {"intermediate": 48, "activation": "$act"}, {"hidden": 32, "act": c.hidden_activation}
    )
    assert cfg.act == "gelu_pytorch_tanh"
    with torch.no_grad():
        block.gate_up.copy_(torch.cat([ref.gate_proj.weight, ref.up_proj.weight]))
        block.down.copy_(ref.down_proj.weight)
    x = torch.randn(7, 32) * 2
    assert _rel(block(x), ref(x)) < TOL


def _situ(g: torch.Tensor, u: torch.Tensor, beta: float, linear: float | None) -> torch.Tensor:
    """Kimi K3's SiTU as its fact sheet writes it, in fp64: [b tanh(g / b) sigmoid(g)] [b_l tanh(u / b_l)]."""
    g, u = g.double(), u.double()
    lin = u if linear is None else linear * torch.tanh(u / linear)
    return beta * torch.tanh(g / beta) * torch.sigmoid(g) * lin


@pytest.mark.parametrize("seed", SEEDS[:2])
@pytest.mark.parametrize("linear", [25.0, None])
def test_situ_mlp_and_experts_match_the_formula(seed: int, linear: float | None) -> None:
    """SiTU (Kimi K3) as the swiglu block's and the MoE block's activation, fp32 inside, against
    the formula in fp64 on weights scaled so that g and u reach past both bounds (|g| up to ~30,
    |u| up to ~80: tanh saturates); the linear beta null leaves u as is. Not SiLU: the outputs
    differ from SwiGLU's by far more than the tolerance."""
    torch.manual_seed(seed)
    opts = {"activation": "situ", "situ_beta": 4.0, "situ_linear_beta": linear, "fp32": True}
    block, cfg = _block("swiglu", {"intermediate": 48} | opts, {"hidden": 32})
    assert (cfg.act, cfg.consts) == ("situ", (4.0, linear or 0.0))
    with torch.no_grad():
        block.gate_up.copy_(torch.randn(96, 32) * 2)
        block.down.copy_(torch.randn(32, 48) / 48**0.5)
    x = torch.randn(7, 32) * 2
    g, u = (x @ block.gate_up.T).chunk(2, dim=-1)
    assert g.abs().max() > 3 * 4.0 and (linear is None or u.abs().max() > 2 * linear)
    want = _situ(g, u, 4.0, linear) @ block.down.double().T
    assert _rel(block(x), want.float()) < TOL
    silu = (torch.nn.functional.silu(g) * u) @ block.down.T
    assert _rel(silu, want.float()) > 0.1
    moe, _ = _block("moe", {"experts": 4, "top_k": 2, "intermediate": 24} | opts, {"hidden": 32})
    with torch.no_grad():
        moe.router.copy_(torch.randn(4, 32))
        moe.gate_up.copy_(torch.randn(4, 48, 32) * 2)
        moe.down.copy_(torch.randn(4, 32, 24) / 24**0.5)
    w, ids = torch.softmax(x @ moe.router.T, -1).topk(2, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    want = torch.zeros(7, 32, dtype=torch.float64)
    for t in range(7):
        for slot in range(2):
            e = int(ids[t, slot])
            ge, ue = (moe.gate_up[e] @ x[t]).chunk(2)
            want[t] += w[t, slot].double() * (moe.down[e].double() @ _situ(ge, ue, 4.0, linear))
    assert _rel(moe(x), want.float()) < TOL


def _rms(v: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return v / torch.sqrt((v * v).mean(-1, keepdim=True) + eps) * w


@pytest.mark.parametrize("seed", SEEDS[:2])
@pytest.mark.parametrize("norm", [True, False])
def test_latent_moe_matches_the_formula(seed: int, norm: bool) -> None:
    """Kimi K3's latent MoE: sigmoid scores + correction bias select the top 2 of 8 (the bias
    only selects), weights renormalised and scaled by 2.5, experts with SiTU in a latent width
    of 24 between W_ld and W_lu (with and without the latent RMSNorm, eps 1e-5), the shared
    expert at the hidden width 32 on x; against a loop over tokens in fp64."""
    torch.manual_seed(seed)
    opts = {"experts": 8, "top_k": 2, "intermediate": 16, "score": "sigmoid", "correction_bias": True,
            "routed_scale": 2.5, "shared_intermediate": 40, "activation": "situ", "fp32": True,
            "latent": 24, "latent_norm": norm, "latent_norm_eps": 1e-5}  # fmt: skip
    moe, cfg = _block("moe", opts, {"hidden": 32})
    assert (cfg.latent, cfg.latent_norm) == (24, norm)
    assert moe.gate_up.shape == (8, 32, 24) and moe.down.shape == (8, 24, 16)
    assert (moe.latent_norm is not None) == norm
    for p in moe.parameters():
        p.copy_(
            torch.randn(p.shape) / (p.shape[-1] ** 0.5 if p.dim() > 1 else 1)
            + (p.dim() == 1 and p.numel() == 24)
        )
    x = torch.randn(6, 32)
    d = {n: p.double() for n, p in moe.named_parameters()}
    xd = x.double()
    want = torch.zeros(6, 32, dtype=torch.float64)
    for t in range(6):
        sc = torch.sigmoid(d["router"] @ xd[t])  # [E]
        pick = (sc + d["correction_bias"]).topk(2).indices
        w = sc[pick] / sc[pick].sum() * 2.5
        u = d["latent_down"] @ xd[t]  # [L]
        r = sum(
            w[j] * (d["down"][e] @ _situ(*(d["gate_up"][e] @ u).chunk(2), 4.0, 25.0))
            for j, e in enumerate(pick)
        )
        r = _rms(r, d["latent_norm"], 1e-5) if norm else r
        sh = d["shared.down"] @ _situ(*(d["shared.gate_up"] @ xd[t]).chunk(2), 4.0, 25.0)
        want[t] = d["latent_up"] @ r + sh
    assert _rel(moe(x), want.float()) < TOL


def test_situ_betas_must_be_positive() -> None:
    for opts in ({"situ_beta": 0.0}, {"situ_linear_beta": -1.0}):
        with pytest.raises(ValueError, match="situ's betas must be > 0"):
            _block("swiglu", {"intermediate": 8, "activation": "situ"} | opts, {"hidden": 16})


def test_an_activation_the_blocks_lack_is_refused_by_name() -> None:
    said = "activation 'relu2' is not implemented by the gated MLPs; known: silu"
    for kind, opts in (
        ("swiglu", {"intermediate": 8}),
        ("moe", {"experts": 4, "top_k": 2, "intermediate": 8}),
    ):
        with pytest.raises(ValueError, match=said):
            _block(kind, opts | {"activation": "$act"}, {"hidden": 16, "act": "relu2"})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_centred_norm_and_scaled_embedding_match_gemma3(dtype: torch.dtype) -> None:
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm, Gemma3TextScaledWordEmbedding

    torch.manual_seed(0)
    ref = Gemma3RMSNorm(40, eps=1e-6)
    with torch.no_grad():
        ref.weight.normal_(0, 0.5)
    ref = ref.to(dtype)
    ops = OpTable(CPU, dtype)
    ops.need("rms_norm", {"weight_in_fp32"})
    ops.need("embedding")
    ops = ops.resolve()
    norm = RMSNorm(NormCfg(40, 1e-6, True, zero_centred=True), ops).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(ref.weight)
    x = (torch.randn(5, 40) * 3).to(dtype)
    assert torch.equal(norm(x), ref(x))
    kept = norm.scale()  # 1 + w is kept on the weight, formed again where the weight is written
    assert norm.scale() is kept
    with torch.no_grad():
        ref.weight.normal_(0, 0.5)
        norm.weight[:20].copy_(ref.weight[:20])  # in place, through a view (as the loader writes)
        norm.weight[20:].copy_(ref.weight[20:])
    assert torch.equal(norm(x), ref(x)) and norm.scale() is kept  # the same buffer (graphs read it)
    emb_ref = Gemma3TextScaledWordEmbedding(50, 40, 0, embed_scale=40**0.5).to(dtype)
    emb = Embedding(EmbeddingCfg(50, 40, scale=40**0.5), ops).to(dtype)
    with torch.no_grad():
        emb.weight.copy_(emb_ref.weight)
    ids = torch.tensor([3, 0, 49, 7])
    assert torch.equal(emb(ids), emb_ref(ids))


@pytest.mark.parametrize("seed", SEEDS[:2])
@pytest.mark.parametrize("bias", [False, True])
def test_plain_mlp_matches_arcee_mlp(seed: int, bias: bool) -> None:
    """The non-gated MLP (sdk/blocks/plain_mlp.py) against ArceeMLP: down(relu(up x + b)^2) + b."""
    from transformers import ArceeConfig
    from transformers.models.arcee.modeling_arcee import ArceeMLP

    torch.manual_seed(seed)
    ref = ArceeMLP(ArceeConfig(hidden_size=32, intermediate_size=48, mlp_bias=bias)).eval()
    block, _ = _block(
        "mlp", {"intermediate": 48, "activation": "$act", "bias": bias}, {"hidden": 32, "act": "relu2"}
    )
    with torch.no_grad():
        block.up.copy_(ref.up_proj.weight)
        block.down.copy_(ref.down_proj.weight)
        if bias:
            block.up_bias.copy_(ref.up_proj.bias)
            block.down_bias.copy_(ref.down_proj.bias)
    x = torch.randn(7, 32) * 2
    assert _rel(block(x), ref(x)) < TOL


def test_a_plain_mlp_activation_it_lacks_is_refused_by_name() -> None:
    with pytest.raises(
        ValueError, match="activation 'xielu' is not implemented by the plain MLP; known: relu2"
    ):
        _block("mlp", {"intermediate": 8, "activation": "$act"}, {"hidden": 16, "act": "xielu"})
