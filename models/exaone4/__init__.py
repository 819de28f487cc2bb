# generated from spec.yaml@6b3fcd4a2441, do not edit
"""EXAONE 4 (generated; the source of truth is spec.yaml)."""
