# generated from spec.yaml@102e10611415, do not edit
"""GLM-5.3-Flash (generated; the source of truth is spec.yaml)."""
