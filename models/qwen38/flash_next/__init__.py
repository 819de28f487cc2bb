# generated from spec.yaml@93081f484c4a, do not edit
"""Qwen3.8-Flash-Next (generated; the source of truth is spec.yaml)."""
