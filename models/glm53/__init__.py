# generated from spec.yaml@bbb681bc043d, do not edit
"""GLM-5.3 (generated; the source of truth is spec.yaml)."""
