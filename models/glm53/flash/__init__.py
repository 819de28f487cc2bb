# generated from spec.yaml@4d94decab04e, do not edit
"""GLM-5.3-Flash (generated; the source of truth is spec.yaml)."""
