# generated from spec.yaml@a6bc083e6796, do not edit
"""SmolLM3 (generated; the source of truth is spec.yaml)."""
