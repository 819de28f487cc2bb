# generated from spec.yaml@2c9982f07190, do not edit
"""Kimi Linear: the execution-plane model, composed from the block library.

Each layer: x + attn(norm(x)), then x + mlp(norm(x)).
"""

from typing import ClassVar

from dayzero.sdk.blocks.decoder import Decoder
from dayzero.sdk.blocks.kda import KdaAttention
from dayzero.sdk.blocks.mla import MlaAttention
from dayzero.sdk.blocks.mlp import MoE, SwiGLU


class Model(Decoder):
    ATTENTION: ClassVar[dict[str, type]] = {"kda": KdaAttention, "mla": MlaAttention}  # block kind -> module
    MLP: ClassVar[dict[str, type]] = {"swiglu": SwiGLU, "moe": MoE}
