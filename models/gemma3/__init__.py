# generated from spec.yaml@fb464029882f, do not edit
"""Gemma 3 (generated; the source of truth is spec.yaml)."""
