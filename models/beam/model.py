# generated from spec.yaml@f7e3e825befc, do not edit
"""Reflection Beam: the execution-plane model, composed from the block library.

Each layer: x + post_norm(attn(norm(x))), then the same around the MLP (depth-scaled adds).
"""

from typing import ClassVar

from dayzero.sdk.blocks.attention import GqaAttention
from dayzero.sdk.blocks.decoder import Decoder
from dayzero.sdk.blocks.mlp import MoE, SwiGLU


class Model(Decoder):
    ATTENTION: ClassVar[dict[str, type]] = {"gqa": GqaAttention}  # block kind -> module
    MLP: ClassVar[dict[str, type]] = {"swiglu": SwiGLU, "moe": MoE}
