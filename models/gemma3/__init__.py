# generated from spec.yaml@43ab0f10afb9, do not edit
"""Gemma 3 (generated; the source of truth is spec.yaml)."""
