# generated from spec.yaml@dc12bec99976, do not edit
"""OLMo 2 (generated; the source of truth is spec.yaml)."""
