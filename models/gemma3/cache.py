# generated from spec.yaml@77509b17d200, do not edit
"""Gemma 3: the cache geometry handed to the scheduler, one group per distinct cache kind.

Sizes (per-token row, window) are resolved from the HF config when a model is built."""

from dayzero.sdk.engine.geometry import GroupDecl

CACHE_GROUPS = (
    GroupDecl(name="kv_swa", kind="sliding", members=("sliding.kv",)),
    GroupDecl(name="kv", kind="paged", members=("full.kv",)),
)
