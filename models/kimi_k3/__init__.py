# generated from spec.yaml@bcd6ac27e615, do not edit
"""Kimi K3 (generated; the source of truth is spec.yaml)."""
