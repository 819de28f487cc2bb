# generated from spec.yaml@cb6fd7dd0c69, do not edit
"""GLM-5.3 (generated; the source of truth is spec.yaml)."""
