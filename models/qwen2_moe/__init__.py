# generated from spec.yaml@c386b3a5b231, do not edit
"""Qwen2-MoE (generated; the source of truth is spec.yaml)."""
