# generated from spec.yaml@3299ae2cb475, do not edit
"""GLM-5.3-Flash (generated; the source of truth is spec.yaml)."""
