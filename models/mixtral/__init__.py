# generated from spec.yaml@943b636ea9fb, do not edit
"""Mixtral (generated; the source of truth is spec.yaml)."""
