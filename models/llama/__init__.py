# generated from spec.yaml@db5a87193ee0, do not edit
"""Llama (generated; the source of truth is spec.yaml)."""
