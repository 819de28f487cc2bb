# generated from spec.yaml@d6c0f885b68c, do not edit
"""Llama (generated; the source of truth is spec.yaml)."""
