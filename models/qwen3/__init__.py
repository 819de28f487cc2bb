# generated from spec.yaml@8ad9343f9939, do not edit
"""Qwen3 (generated; the source of truth is spec.yaml)."""
