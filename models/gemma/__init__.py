# generated from spec.yaml@d7a7340b9b38, do not edit
"""Gemma (generated; the source of truth is spec.yaml)."""
