# generated from spec.yaml@10f73b15d412, do not edit
"""GLM-5.3 (generated; the source of truth is spec.yaml)."""
