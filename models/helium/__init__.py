# generated from spec.yaml@20a3880ed740, do not edit
"""Helium (generated; the source of truth is spec.yaml)."""
