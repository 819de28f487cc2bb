# generated from spec.yaml@a6bc083e6796, do not edit
"""SmolLM3: the cache geometry handed to the scheduler, one group per distinct cache kind.

Sizes (per-token row, window) are resolved from the HF config when a model is built."""

from dayzero.sdk.engine.geometry import GroupDecl

CACHE_GROUPS = (
    GroupDecl(
        name="kv",
        kind="paged",
        members=(
            "rope.kv",
            "nope.kv",
        ),
    ),
)
