# generated from spec.yaml@73df7d7fcea9, do not edit
"""GLM-5.3 (generated; the source of truth is spec.yaml)."""
