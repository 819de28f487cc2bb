# generated from spec.yaml@9997cae5b3cf, do not edit
"""Reflection Beam (generated; the source of truth is spec.yaml)."""
