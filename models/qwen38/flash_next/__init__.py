# generated from spec.yaml@99b3aef5976e, do not edit
"""Qwen3.8-Flash-Next (generated; the source of truth is spec.yaml)."""
