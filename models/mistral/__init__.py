# generated from spec.yaml@87b4ce79605e, do not edit
"""Mistral (generated; the source of truth is spec.yaml)."""
