# generated from spec.yaml@40d8a6bf3fef, do not edit
"""GLM-5.3: the execution-plane model, composed from the block library.

Each layer: x + attn(norm(x)), then x + mlp(norm(x)).
"""

from typing import ClassVar

from dayzero.sdk.blocks.decoder import Decoder
from dayzero.sdk.blocks.mla import MlaAttention
from dayzero.sdk.blocks.mlp import MoE, SwiGLU


class Model(Decoder):
    ATTENTION: ClassVar[dict[str, type]] = {"mla": MlaAttention}  # block kind -> module
    MLP: ClassVar[dict[str, type]] = {"swiglu": SwiGLU, "moe": MoE}
