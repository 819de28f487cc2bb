# generated from spec.yaml@1d8b429d4774, do not edit
"""GLM-5.3-Flash (generated; the source of truth is spec.yaml)."""
