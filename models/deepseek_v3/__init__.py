# generated from spec.yaml@518afcf9b9c3, do not edit
"""DeepSeek-V3 (generated; the source of truth is spec.yaml)."""
