"""Reference backend: plain torch, any device, every op; the ground truth for faster kernels."""

# register on import
from dayzero.kernels.reference import (  # noqa: F401
    attention,
    basic,
    hyper,
    linear_attention,
    mla,
    moe,
    ngram,
    packed,
    qsa,
    sampling,
)
