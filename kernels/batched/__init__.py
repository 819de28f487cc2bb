"""Batched backend: plain torch, but vectorised over rows (padded attention through SDPA; MLA in
the absorbed form for decode and sparse selections; the sparse indexers over the block table's
fixed width; the short convolution, the linear-attention and n-gram decode steps), over experts
(grouped GEMM) and over the sampled rows, so a step costs a handful of launches instead of one
per row or expert. Each kernel is tested against the reference backend (tests/test_kernels.py,
tests/test_mla_kernels.py, tests/test_linear_attention.py)."""

from dayzero.kernels.batched import (  # noqa: F401  (register)
    attention,
    indexer,
    linear_attention,
    mla,
    moe,
    ngram,
    sampling,
)
