# generated from spec.yaml@2336bc5d7f66, do not edit
"""Kimi K3 (generated; the source of truth is spec.yaml)."""
