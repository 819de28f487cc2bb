# generated from spec.yaml@842252ed71ef, do not edit
"""Gemma (generated; the source of truth is spec.yaml)."""
