# generated from spec.yaml@0505fd392444, do not edit
"""Reflection Beam (generated; the source of truth is spec.yaml)."""
