# generated from spec.yaml@618a2e0e07e1, do not edit
"""Qwen3.8: the execution-plane model, composed from the block library.

Each layer: x + attn(norm(x)), then x + mlp(norm(x)).
"""

from typing import ClassVar

from dayzero.sdk.blocks.attention import GqaAttention
from dayzero.sdk.blocks.decoder import Decoder
from dayzero.sdk.blocks.gdn import GatedDeltaNet
from dayzero.sdk.blocks.mlp import MoE


class Model(Decoder):
    ATTENTION: ClassVar[dict[str, type]] = {
        "gated_deltanet": GatedDeltaNet,
        "gqa": GqaAttention,
    }  # block kind -> module
    MLP: ClassVar[dict[str, type]] = {"moe": MoE}
