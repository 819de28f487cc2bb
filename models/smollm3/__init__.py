# generated from spec.yaml@6b941114ce6e, do not edit
"""SmolLM3 (generated; the source of truth is spec.yaml)."""
