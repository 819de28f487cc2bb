# generated from spec.yaml@2517df8ea612, do not edit
"""GLM-4.5 (generated; the source of truth is spec.yaml)."""
