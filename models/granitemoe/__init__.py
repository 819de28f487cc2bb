# generated from spec.yaml@eced1c549271, do not edit
"""Granite MoE (generated; the source of truth is spec.yaml)."""
