# generated from spec.yaml@dd07372d92cc, do not edit
"""gpt-oss (generated; the source of truth is spec.yaml)."""
