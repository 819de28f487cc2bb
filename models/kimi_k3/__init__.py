# generated from spec.yaml@3d2b04768274, do not edit
"""Kimi K3 (generated; the source of truth is spec.yaml)."""
