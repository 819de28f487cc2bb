# generated from spec.yaml@2e9b50b70299, do not edit
"""OLMo 3 (generated; the source of truth is spec.yaml)."""
