# generated from spec.yaml@78f1789229d9, do not edit
"""GLM-5.3-Flash: the execution-plane model, composed from the block library.

Each layer: N residual streams mixed by hyper-connections around attn, then the MLP.
"""

from typing import ClassVar

from dayzero.sdk.blocks.decoder import Decoder
from dayzero.sdk.blocks.kda import KdaAttention
from dayzero.sdk.blocks.mla import MlaAttention
from dayzero.sdk.blocks.mlp import MoE, SwiGLU


class Model(Decoder):
    ATTENTION: ClassVar[dict[str, type]] = {"kda": KdaAttention, "mla": MlaAttention}  # block kind -> module
    MLP: ClassVar[dict[str, type]] = {"swiglu": SwiGLU, "moe": MoE}
