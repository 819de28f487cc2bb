# generated from spec.yaml@113323a48f37, do not edit
"""Qwen3.8 (generated; the source of truth is spec.yaml)."""
