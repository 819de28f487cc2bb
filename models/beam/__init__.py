# generated from spec.yaml@a64358074033, do not edit
"""Reflection Beam (generated; the source of truth is spec.yaml)."""
