"""Parity suite: dayzero against the reference class on the same checkpoint (`runner`), and the
tiny random checkpoints it runs on in tests (`tiny`)."""

from dayzero.sdk.parity.runner import Report, run_parity

__all__ = ["Report", "run_parity"]
