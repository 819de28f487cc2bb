# generated from spec.yaml@fa68adb79894, do not edit
"""Qwen3.8 (generated; the source of truth is spec.yaml)."""
