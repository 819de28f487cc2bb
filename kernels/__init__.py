"""dayzero.kernels: the portable op API and its backends (filled in by the spec-to-tokens work)."""
