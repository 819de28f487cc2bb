# generated from spec.yaml@c237b9a2d173, do not edit
"""Llama (generated; the source of truth is spec.yaml)."""
