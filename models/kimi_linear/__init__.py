# generated from spec.yaml@2c9982f07190, do not edit
"""Kimi Linear (generated; the source of truth is spec.yaml)."""
