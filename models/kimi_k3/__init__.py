# generated from spec.yaml@2deb80019095, do not edit
"""Kimi K3 (generated; the source of truth is spec.yaml)."""
