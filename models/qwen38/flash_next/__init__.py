# generated from spec.yaml@220216eebc82, do not edit
"""Qwen3.8-Flash-Next (generated; the source of truth is spec.yaml)."""
