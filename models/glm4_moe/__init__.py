# generated from spec.yaml@7a20516f51ef, do not edit
"""GLM-4.5 (generated; the source of truth is spec.yaml)."""
