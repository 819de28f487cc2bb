# generated from spec.yaml@611724d4007e, do not edit
"""GLM-5.3 (generated; the source of truth is spec.yaml)."""
