# generated from spec.yaml@d19e97f39603, do not edit
"""GLM-5.3 (generated; the source of truth is spec.yaml)."""
