# generated from spec.yaml@74c3c6b3a3ff, do not edit
"""Seed-OSS (generated; the source of truth is spec.yaml)."""
