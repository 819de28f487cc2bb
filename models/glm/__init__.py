# generated from spec.yaml@a89581a80736, do not edit
"""GLM (generated; the source of truth is spec.yaml)."""
