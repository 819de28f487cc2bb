# generated from spec.yaml@5ff9afd28781, do not edit
"""GLM-5.3-Flash (generated; the source of truth is spec.yaml)."""
