# generated from spec.yaml@f7e3e825befc, do not edit
"""Reflection Beam: the cache geometry handed to the scheduler, one group per distinct cache kind.

Sizes (per-token row, window) are resolved from the HF config when a model is built."""

from dayzero.sdk.engine.geometry import GroupDecl

CACHE_GROUPS = (
    GroupDecl(name="kv_swa", kind="sliding", members=("sliding.kv",)),
    GroupDecl(name="kv", kind="paged", members=("full.kv",)),
)
