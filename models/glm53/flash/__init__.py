# generated from spec.yaml@36953a73af4c, do not edit
"""GLM-5.3-Flash (generated; the source of truth is spec.yaml)."""
