# generated from spec.yaml@cec6b969d1bc, do not edit
"""Mistral (generated; the source of truth is spec.yaml)."""
