# generated from spec.yaml@78f1789229d9, do not edit
"""GLM-5.3-Flash: the cache geometry handed to the scheduler, one group per distinct cache kind.

Sizes (per-token row, window) are resolved from the HF config when a model is built."""

from dayzero.sdk.engine.geometry import GroupDecl

CACHE_GROUPS = (
    GroupDecl(
        name="state",
        kind="state",
        members=(
            "kda.conv",
            "kda.recurrent",
        ),
    ),
    GroupDecl(
        name="mla",
        kind="paged",
        members=(
            "kpool.latent",
            "kpool_shared.latent",
        ),
    ),
    GroupDecl(name="index", kind="paged", members=("kpool.index",)),
)
