# generated from spec.yaml@40d8a6bf3fef, do not edit
"""GLM-5.3: the cache geometry handed to the scheduler, one group per distinct cache kind.

Sizes (per-token row, window) are resolved from the HF config when a model is built."""

from dayzero.sdk.engine.geometry import GroupDecl

CACHE_GROUPS = (
    GroupDecl(
        name="mla",
        kind="paged",
        members=(
            "dsa.latent",
            "dsa_shared.latent",
        ),
    ),
    GroupDecl(name="index", kind="paged", members=("dsa.index",)),
)
