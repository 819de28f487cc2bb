# generated from spec.yaml@df8f36dcfcfc, do not edit
"""Reflection Beam (generated; the source of truth is spec.yaml)."""
