# generated from spec.yaml@6b4c6945bee6, do not edit
"""Qwen3 (generated; the source of truth is spec.yaml)."""
