"""Triton backend (CUDA): packed-weight GEMMs. Registered only where `triton` imports (CUDA builds
of torch bring it); every kernel is checked against the reference backend on the GPU
(scripts/gpu_bringup.sh runs tests/gpu/test_triton_packed.py)."""

import importlib.util

import torch

from dayzero.kernels.ops import PACKED_FORMATS
from dayzero.kernels.registry import Capabilities, register

if importlib.util.find_spec("triton") is not None:
    from dayzero.kernels.triton import packed

    _caps = dict(
        devices=frozenset({"cuda"}),
        dtypes=frozenset({torch.bfloat16, torch.float16}),
        min_capability=(9, 0),
        priority=10,
    )
    register("linear_packed", "triton", Capabilities(features=frozenset({"bias", *PACKED_FORMATS}), **_caps))(
        packed.linear_packed
    )
    register(
        "moe_experts_packed",
        "triton",
        Capabilities(features=frozenset({"fp32", "limit", *PACKED_FORMATS}), **_caps),
    )(packed.moe_experts_packed)
