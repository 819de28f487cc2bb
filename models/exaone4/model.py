# generated from spec.yaml@6b3fcd4a2441, do not edit
"""EXAONE 4: the execution-plane model, composed from the block library.

Each layer: x + post_norm(attn(x)), then x + post_norm(mlp(x)).
"""

from typing import ClassVar

from dayzero.sdk.blocks.attention import GqaAttention
from dayzero.sdk.blocks.decoder import Decoder
from dayzero.sdk.blocks.mlp import SwiGLU


class Model(Decoder):
    ATTENTION: ClassVar[dict[str, type]] = {"gqa": GqaAttention}  # block kind -> module
    MLP: ClassVar[dict[str, type]] = {"swiglu": SwiGLU}
