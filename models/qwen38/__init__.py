# generated from spec.yaml@618a2e0e07e1, do not edit
"""Qwen3.8 (generated; the source of truth is spec.yaml)."""
