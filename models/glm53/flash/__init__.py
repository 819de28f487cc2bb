# generated from spec.yaml@e0f1e0717f52, do not edit
"""GLM-5.3-Flash (generated; the source of truth is spec.yaml)."""
