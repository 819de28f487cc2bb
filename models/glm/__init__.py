# generated from spec.yaml@1f44cea30f44, do not edit
"""GLM (generated; the source of truth is spec.yaml)."""
