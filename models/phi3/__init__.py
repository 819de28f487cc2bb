# generated from spec.yaml@7416e506e022, do not edit
"""Phi-3 (generated; the source of truth is spec.yaml)."""
