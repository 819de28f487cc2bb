# generated from spec.yaml@36a90a52f921, do not edit
"""Phi-3: the cache geometry handed to the scheduler, one group per distinct cache kind.

Sizes (per-token row, window) are resolved from the HF config when a model is built."""

from dayzero.sdk.engine.geometry import GroupDecl

CACHE_GROUPS = (GroupDecl(name="kv_swa", kind="sliding", members=("attn.kv",)),)
