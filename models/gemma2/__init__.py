# generated from spec.yaml@5d533c689df2, do not edit
"""Gemma 2 (generated; the source of truth is spec.yaml)."""
