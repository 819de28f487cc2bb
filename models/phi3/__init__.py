# generated from spec.yaml@448a64a1611c, do not edit
"""Phi-3 (generated; the source of truth is spec.yaml)."""
