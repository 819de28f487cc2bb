# generated from spec.yaml@b5990ce6693f, do not edit
"""GLM-5.3 (generated; the source of truth is spec.yaml)."""
