# generated from spec.yaml@618a2e0e07e1, do not edit
"""Qwen3.8: the cache geometry handed to the scheduler, one group per distinct cache kind.

Sizes (per-token row, window) are resolved from the HF config when a model is built."""

from dayzero.sdk.engine.geometry import GroupDecl

CACHE_GROUPS = (
    GroupDecl(
        name="state",
        kind="state",
        members=(
            "gdn.conv",
            "gdn.recurrent",
        ),
    ),
    GroupDecl(name="kv", kind="paged", members=("attn.kv",)),
)
