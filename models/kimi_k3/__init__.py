# generated from spec.yaml@e5d3d8f946f9, do not edit
"""Kimi K3 (generated; the source of truth is spec.yaml)."""
