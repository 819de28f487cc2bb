# generated from spec.yaml@23fc187a5cdf, do not edit
"""Helium (generated; the source of truth is spec.yaml)."""
