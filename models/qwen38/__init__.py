# generated from spec.yaml@74019530496f, do not edit
"""Qwen3.8 (generated; the source of truth is spec.yaml)."""
