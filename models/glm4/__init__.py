# generated from spec.yaml@da40d183f802, do not edit
"""GLM-4-0414 (generated; the source of truth is spec.yaml)."""
