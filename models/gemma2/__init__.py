# generated from spec.yaml@cd67428d3d31, do not edit
"""Gemma 2 (generated; the source of truth is spec.yaml)."""
