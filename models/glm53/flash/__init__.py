# generated from spec.yaml@6afab455fcd4, do not edit
"""GLM-5.3-Flash (generated; the source of truth is spec.yaml)."""
