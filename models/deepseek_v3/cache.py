# generated from spec.yaml@518afcf9b9c3, do not edit
"""DeepSeek-V3: the cache geometry handed to the scheduler, one group per distinct cache kind.

Sizes (per-token row, window) are resolved from the HF config when a model is built."""

from dayzero.sdk.engine.geometry import GroupDecl

CACHE_GROUPS = (GroupDecl(name="mla", kind="paged", members=("attn.latent",)),)
