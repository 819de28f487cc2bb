# generated from spec.yaml@2905f5682cc3, do not edit
"""Reflection Beam (generated; the source of truth is spec.yaml)."""
