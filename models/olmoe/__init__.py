# generated from spec.yaml@0ab2dddaeadb, do not edit
"""OLMoE (generated; the source of truth is spec.yaml)."""
