# generated from spec.yaml@2336bc5d7f66, do not edit
"""Kimi K3: the cache geometry handed to the scheduler, one group per distinct cache kind.

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
    GroupDecl(name="mla", kind="paged", members=("mla.latent",)),
)
