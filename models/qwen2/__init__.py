# generated from spec.yaml@7ba26096362a, do not edit
"""Qwen2 (generated; the source of truth is spec.yaml)."""
