"""Reference backend: plain torch, any device, every op; the ground truth for faster kernels."""

from dayzero.kernels.reference import attention, basic, linear_attention, mla, moe, ngram, packed, sampling  # noqa: F401  (register on import)
