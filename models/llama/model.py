# generated from spec.yaml@8659430fa18c, do not edit
"""Llama: the execution-plane model, composed from the block library.

Each layer: x + attn(norm(x)), then x + mlp(norm(x)).
"""

from typing import ClassVar

from dayzero.sdk.blocks.attention import GqaAttention
from dayzero.sdk.blocks.decoder import Decoder
from dayzero.sdk.blocks.mlp import SwiGLU


class Model(Decoder):
    ATTENTION: ClassVar[dict[str, type]] = {"gqa": GqaAttention}  # block kind -> module
    MLP: ClassVar[dict[str, type]] = {"swiglu": SwiGLU}
