# generated from spec.yaml@36a90a52f921, do not edit
"""Phi-3 (generated; the source of truth is spec.yaml)."""
