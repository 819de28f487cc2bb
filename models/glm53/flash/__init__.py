# generated from spec.yaml@49ccdfb43573, do not edit
"""GLM-5.3-Flash (generated; the source of truth is spec.yaml)."""
