# generated from spec.yaml@9884cdf4b5eb, do not edit
"""Mistral (generated; the source of truth is spec.yaml)."""
