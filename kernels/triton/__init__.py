"""Triton backend (CUDA): packed-weight GEMMs (`packed`), dense decode GEMVs (`linear`), paged GQA
attention reading the cache in place (`attention`) and over a sparse indexer's selection
(`select_attention`), absorbed-MLA decode and sparse attention over the latent cache in place
(`mla`), the DSA, KPool and QSA indexers' scores (`indexer`) and their top-k (`topk`), the delta
rules' and short conv's decode steps and their gates (`linear_attention`), both kinds
of hyper-connections (`hyper`), stacked experts read in place (`moe`), MoE routing (`routing`),
RMSNorm and the gated RMSNorm (`norm`), the fused small ops (`fused`: residual add + norm, head
norm + RoPE, output gate, SwiGLU, the K/V cache write), the greedy sampler (`sampling`).
Registered only where `triton` imports (CUDA builds of torch bring it); every kernel is checked
against the reference backend in Triton's CPU interpreter in CI (tests/test_triton_interpreter.py,
tests/test_mla_kernels.py) and on the GPU (scripts/gpu_bringup.sh runs tests/test_triton_packed.py,
tests/test_triton_cuda.py)."""

import importlib.util

import torch

from dayzero.kernels.ops import GATED_ACTS, PACKED_FORMATS
from dayzero.kernels.registry import OPS, Capabilities, register

if importlib.util.find_spec("triton") is not None:
    from dayzero.kernels.triton import (
        attention,
        fused,
        hyper,
        indexer,
        linear,
        linear_attention,
        mla,
        moe,
        norm,
        packed,
        routing,
        sampling,
        select_attention,
        topk,
    )

    _half = dict(  # the packed GEMMs: shapes from the tensors alone, no host sync (graph-safe)
        devices=frozenset({"cuda"}),
        dtypes=frozenset({torch.bfloat16, torch.float16}),
        min_capability=(9, 0),
        graphs=True,
    )
    _any = dict(devices=frozenset({"cuda"}), min_capability=(8, 0), priority=10, graphs=True)
    register(
        "linear_packed",
        "triton",
        Capabilities(features=frozenset({"bias", *PACKED_FORMATS}), priority=10, **_half),
    )(packed.linear_packed)
    register(
        "moe_experts_packed",
        "triton",
        Capabilities(
            features=frozenset({"fp32", "limit", "skip", *GATED_ACTS, *PACKED_FORMATS}), priority=10, **_half
        ),
    )(packed.moe_experts_packed)
    register(
        "gqa_attention",
        "triton",
        Capabilities(
            features=frozenset({"causal", "sliding_window", "softcap", "sinks"}),
            head_dims=frozenset(range(16, 257, 8)),
            **_any,
        ),
    )(attention.gqa_attention)
    # a sparse indexer's selection read in place (below the paged kernel, which it runs without one)
    register(
        "gqa_attention",
        "triton_select",
        Capabilities(
            features=frozenset({"causal", "sliding_window", "softcap", "sinks", "select"}),
            head_dims=frozenset(range(16, 257, 8)),
            **(_any | {"priority": 9}),
        ),
    )(select_attention.gqa_attention_select)
    # absorbed decode and sparse selections in place; a dense step's prefill rows through batched/
    register("mla_attention", "triton", Capabilities(features=frozenset({"causal", "select"}), **_any))(
        mla.mla_attention
    )
    # the indexers' scores over the paged index keys in place, their top-k by a radix select
    register("dsa_scores", "triton", Capabilities(**_any))(indexer.dsa_scores)
    register("dsa_index", "triton", Capabilities(**_any))(indexer.dsa_index)
    register("kpool_scores", "triton", Capabilities(**_any))(indexer.kpool_scores)
    register("qsa_scores", "triton", Capabilities(**_any))(indexer.qsa_scores)
    register("qsa_pool", "triton", Capabilities(**_any))(indexer.qsa_pool)
    register("kpool_index", "triton", Capabilities(features=frozenset({"tail"}), **_any))(indexer.kpool_index)
    register("index_topk", "triton", Capabilities(features=frozenset({"tail"}), **_any))(topk.index_topk)
    # the delta rules' and the short conv's decode step (prefill chunks through fla-core where
    # registered, else the reference / batched): above fla (10), whose decode step is not graph-safe
    for op in ("kda_recurrence", "gated_delta_rule", "short_conv"):
        register(op, "triton", Capabilities(features=OPS.get(op).features, **(_any | {"priority": 20})))(
            getattr(linear_attention, op)
        )
    # decode-sized dense linears as a GEMV (F.linear past linear.GEMV_ROWS rows)
    register("linear", "triton", Capabilities(features=frozenset({"bias"}), **_any))(linear.linear)
    register("rms_norm", "triton", Capabilities(features=frozenset({"weight_in_fp32"}), **_any))(
        norm.rms_norm
    )
    register("rope", "triton", Capabilities(features=frozenset({"partial", "neox"}), **_any))(fused.rope)
    for op, fn in (
        ("add_rms_norm", fused.add_rms_norm),
        ("sigmoid_gate", fused.sigmoid_gate),
        ("swiglu", fused.swiglu),
        ("kv_write", fused.kv_write),
        ("qk_norm_rope_write", fused.qk_norm_rope_write),
        ("moe_route", routing.moe_route),
        ("hc_pre", hyper.hc_pre),
        ("hc_post", hyper.hc_post),
        ("hc_lowrank_norm", hyper.hc_lowrank_norm),
        ("hc_lowrank_mix", hyper.hc_lowrank_mix),
        ("rms_norm_gated", norm.rms_norm_gated),
        ("gdn_gates", linear_attention.gdn_gates),
        ("kda_gates", linear_attention.kda_gates),
    ):
        register(op, "triton", Capabilities(features=OPS.get(op).features, **_any))(fn)
    # above the grouped GEMMs (priority 10), which it runs itself for prefill shapes
    register(
        "moe_experts",
        "triton",
        Capabilities(features=OPS.get("moe_experts").features, **(_any | {"priority": 20})),
    )(moe.moe_experts)
    # above the batched sampler (priority 10), which it runs itself for any batch but all-greedy
    register(
        "sample", "triton", Capabilities(features=OPS.get("sample").features, **(_any | {"priority": 20}))
    )(sampling.sample)
