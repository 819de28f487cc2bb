# generated from spec.yaml@e59201d87e0f, do not edit
"""Gemma 3 (generated; the source of truth is spec.yaml)."""
