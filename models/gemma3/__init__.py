# generated from spec.yaml@3b75e5278534, do not edit
"""Gemma 3 (generated; the source of truth is spec.yaml)."""
