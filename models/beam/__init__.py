# generated from spec.yaml@142fd27e2bce, do not edit
"""Reflection Beam (generated; the source of truth is spec.yaml)."""
