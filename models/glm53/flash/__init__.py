# generated from spec.yaml@71ca4cf95570, do not edit
"""GLM-5.3-Flash (generated; the source of truth is spec.yaml)."""
