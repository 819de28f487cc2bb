# generated from spec.yaml@ebf27a52674d, do not edit
"""GLM-5.3 (generated; the source of truth is spec.yaml)."""
