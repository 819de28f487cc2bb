# generated from spec.yaml@220216eebc82, do not edit
"""Qwen3.8-Flash-Next: the execution-plane model, composed from the block library.

Each layer: N residual streams mixed by hyper-connections around attn, then the MLP.
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
