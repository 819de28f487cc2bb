# generated from spec.yaml@74da02532e89, do not edit
"""GLM-5.3 (generated; the source of truth is spec.yaml)."""
