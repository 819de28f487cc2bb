# generated from spec.yaml@f5ee20fc4b4f, do not edit
"""GLM-4.7-Flash: the cache geometry handed to the scheduler, one group per distinct cache kind.

Sizes (per-token row, window) are resolved from the HF config when a model is built."""

from dayzero.sdk.engine.geometry import GroupDecl

CACHE_GROUPS = (GroupDecl(name="mla", kind="paged", members=("attn.latent",)),)
