# generated from spec.yaml@f2896ecfc8ee, do not edit
"""Solar Open (generated; the source of truth is spec.yaml)."""
