# generated from spec.yaml@77509b17d200, do not edit
"""Gemma 3: the execution-plane model, composed from the block library.

Each layer: x + post_norm(attn(norm(x))), then the same around the MLP.
"""

from typing import ClassVar

from dayzero.sdk.blocks.attention import GqaAttention
from dayzero.sdk.blocks.decoder import Decoder
from dayzero.sdk.blocks.mlp import SwiGLU


class Model(Decoder):
    ATTENTION: ClassVar[dict[str, type]] = {"gqa": GqaAttention}  # block kind -> module
    MLP: ClassVar[dict[str, type]] = {"swiglu": SwiGLU}
