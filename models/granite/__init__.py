# generated from spec.yaml@a63fdb4d3b00, do not edit
"""Granite (generated; the source of truth is spec.yaml)."""
