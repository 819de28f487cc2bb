# generated from spec.yaml@f47c80ed43e1, do not edit
"""Qwen3-MoE (generated; the source of truth is spec.yaml)."""
