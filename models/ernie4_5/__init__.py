# generated from spec.yaml@f40306fd64ca, do not edit
"""ERNIE 4.5 (generated; the source of truth is spec.yaml)."""
