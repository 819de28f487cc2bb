# generated from spec.yaml@0ddd31f0d155, do not edit
"""Qwen3.8-Flash-Next (generated; the source of truth is spec.yaml)."""
