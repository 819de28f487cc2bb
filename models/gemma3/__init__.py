# generated from spec.yaml@77509b17d200, do not edit
"""Gemma 3 (generated; the source of truth is spec.yaml)."""
