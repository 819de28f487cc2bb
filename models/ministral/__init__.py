# generated from spec.yaml@87afc116daa4, do not edit
"""Ministral (generated; the source of truth is spec.yaml)."""
