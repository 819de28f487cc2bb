# generated from spec.yaml@94b1644057ac, do not edit
"""Qwen2 (generated; the source of truth is spec.yaml)."""
