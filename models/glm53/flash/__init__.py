# generated from spec.yaml@9a58e723ffab, do not edit
"""GLM-5.3-Flash (generated; the source of truth is spec.yaml)."""
