# generated from spec.yaml@6b3fcd4a2441, do not edit
"""EXAONE 4: the cache geometry handed to the scheduler, one group per distinct cache kind.

Sizes (per-token row, window) are resolved from the HF config when a model is built."""

from dayzero.sdk.engine.geometry import GroupDecl

CACHE_GROUPS = (
    GroupDecl(name="kv_swa", kind="sliding", members=("sliding.kv",)),
    GroupDecl(name="kv", kind="paged", members=("full.kv",)),
)
