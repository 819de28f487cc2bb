# generated from spec.yaml@40d8a6bf3fef, do not edit
"""GLM-5.3 (generated; the source of truth is spec.yaml)."""
