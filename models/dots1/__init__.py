# generated from spec.yaml@68ae44a4639c, do not edit
"""dots.llm1 (generated; the source of truth is spec.yaml)."""
