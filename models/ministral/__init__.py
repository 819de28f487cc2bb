# generated from spec.yaml@b0be41a75c41, do not edit
"""Ministral (generated; the source of truth is spec.yaml)."""
