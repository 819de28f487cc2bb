# generated from spec.yaml@e73b40533c61, do not edit
"""Llama (generated; the source of truth is spec.yaml)."""
