# generated from spec.yaml@5877b091b8b3, do not edit
"""GLM-5.3 (generated; the source of truth is spec.yaml)."""
