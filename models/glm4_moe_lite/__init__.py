# generated from spec.yaml@f5ee20fc4b4f, do not edit
"""GLM-4.7-Flash (generated; the source of truth is spec.yaml)."""
