# generated from spec.yaml@3cb13b041900, do not edit
"""GLM-5.3-Flash (generated; the source of truth is spec.yaml)."""
