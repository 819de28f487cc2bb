"""Batched backend: plain torch, but vectorised over rows (padded attention through SDPA) and over
experts (grouped GEMM), so a step costs a handful of launches instead of one per row or expert.
Each kernel is tested against the reference backend (tests/test_kernels.py)."""

from dayzero.kernels.batched import attention, moe  # noqa: F401  (register on import)
