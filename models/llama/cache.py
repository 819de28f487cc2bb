# generated from spec.yaml@8659430fa18c, do not edit
"""Llama: the cache geometry handed to the scheduler, one group per distinct cache kind.

Sizes (per-token row, window) are resolved from the HF config when a model is built."""

from dayzero.sdk.engine.geometry import GroupDecl

CACHE_GROUPS = (GroupDecl(name="kv", kind="paged", members=("attn.kv",)),)
