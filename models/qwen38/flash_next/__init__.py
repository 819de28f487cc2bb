# generated from spec.yaml@1cc15d6d84e9, do not edit
"""Qwen3.8-Flash-Next (generated; the source of truth is spec.yaml)."""
