# generated from spec.yaml@295532eda313, do not edit
"""Llama (generated; the source of truth is spec.yaml)."""
