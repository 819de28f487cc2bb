# generated from spec.yaml@87b4ce79605e, do not edit
"""Mistral: the cache geometry handed to the scheduler, one group per distinct cache kind.

Sizes (per-token row, window) are resolved from the HF config when a model is built."""

from dayzero.sdk.engine.geometry import GroupDecl

CACHE_GROUPS = (GroupDecl(name="kv_swa", kind="sliding", members=("attn.kv",)),)
