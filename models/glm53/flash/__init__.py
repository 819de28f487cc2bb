# generated from spec.yaml@78f1789229d9, do not edit
"""GLM-5.3-Flash (generated; the source of truth is spec.yaml)."""
