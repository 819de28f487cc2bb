# generated from spec.yaml@2336bc5d7f66, do not edit
"""Kimi K3: the execution-plane model, composed from the block library.

Each layer: attn, then the MLP, each on its norm of a learned mix of the
residual snapshots (attention residuals).
"""

from typing import ClassVar

from dayzero.sdk.blocks.decoder import Decoder
from dayzero.sdk.blocks.kda import KdaAttention
from dayzero.sdk.blocks.mla import MlaAttention
from dayzero.sdk.blocks.mlp import MoE, SwiGLU


class Model(Decoder):
    ATTENTION: ClassVar[dict[str, type]] = {"kda": KdaAttention, "mla": MlaAttention}  # block kind -> module
    MLP: ClassVar[dict[str, type]] = {"swiglu": SwiGLU, "moe": MoE}
