"""The block library: attention kinds, feed-forward kinds, norms and residuals.

`BLOCKS` maps a spec's `kind:` to its definition (`base.BlockDef`). A new block is added once
here, with a torch reference and a test; then any spec may use it.
"""

from dayzero.sdk.blocks import attention, gdn, kda, mla, mlp, plain_mlp  # noqa: F401  (register on import)
from dayzero.sdk.blocks.base import BLOCKS, BlockDef, CacheDecl
from dayzero.sdk.blocks.norm import Embedding, LMHead, RMSNorm, Streams, residual

__all__ = ["BLOCKS", "BlockDef", "CacheDecl", "Embedding", "LMHead", "RMSNorm", "Streams", "residual"]
