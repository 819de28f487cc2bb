# generated from spec.yaml@3b31749ada8b, do not edit
"""GLM-5.3 (generated; the source of truth is spec.yaml)."""
