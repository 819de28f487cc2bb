# generated from spec.yaml@ec24dad6dbcb, do not edit
"""GLM-5.3-Flash (generated; the source of truth is spec.yaml)."""
