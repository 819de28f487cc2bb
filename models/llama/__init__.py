# generated from spec.yaml@d8d57605e047, do not edit
"""Llama (generated; the source of truth is spec.yaml)."""
