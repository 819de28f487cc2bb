# generated from spec.yaml@8fc728218aec, do not edit
"""Qwen3.8-Flash-Next (generated; the source of truth is spec.yaml)."""
