# generated from spec.yaml@220216eebc82, do not edit
"""Qwen3.8-Flash-Next: the cache geometry handed to the scheduler, one group per distinct cache kind.

Sizes (per-token row, window) are resolved from the HF config when a model is built."""

from dayzero.sdk.engine.geometry import GroupDecl

CACHE_GROUPS = (
    GroupDecl(
        name="state",
        kind="state",
        members=(
            "gdn.conv",
            "gdn.recurrent",
            "ngram.ngram_tokens",
            "ngram.ngram_conv",
        ),
    ),
    GroupDecl(name="kv", kind="paged", members=("attn.kv",)),
    GroupDecl(name="index_raw", kind="sliding", members=("attn.index_raw",)),
    GroupDecl(name="index", kind="paged", members=("attn.index",)),
)
