"""The errors a user can cause with a spec or a checkpoint; every floor above raises them.

Each message names where the problem is (the file and field path, the checkpoint tensor) and
what was expected; nothing is loaded or served after one of them.
"""

from __future__ import annotations


class SpecError(ValueError):
    """A spec (or the HF config it is resolved against) that cannot be served as written."""

    def __init__(self, source: str, path: str, message: str) -> None:
        self.source, self.path = source, path
        super().__init__(f"{source}: {path or '(top level)'}: {message}")


class CheckpointError(ValueError):
    """A checkpoint folder or file that cannot be read: missing or truncated files, bad headers,
    a quantization config dayzero does not know."""


class WeightError(ValueError):
    """A checkpoint tensor that does not fit the model: no rule, bad shape or dtype, NaN or inf,
    written twice or never."""
