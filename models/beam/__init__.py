# generated from spec.yaml@67703995cc96, do not edit
"""Reflection Beam (generated; the source of truth is spec.yaml)."""
