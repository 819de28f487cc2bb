# generated from spec.yaml@1fc35dd73bc2, do not edit
"""ERNIE 4.5 (generated; the source of truth is spec.yaml)."""
