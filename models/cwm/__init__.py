# generated from spec.yaml@06f5cabcb138, do not edit
"""CWM (generated; the source of truth is spec.yaml)."""
