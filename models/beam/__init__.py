# generated from spec.yaml@f7e3e825befc, do not edit
"""Reflection Beam (generated; the source of truth is spec.yaml)."""
