# generated from spec.yaml@12e1888b74db, do not edit
"""GLM-4-0414 (generated; the source of truth is spec.yaml)."""
