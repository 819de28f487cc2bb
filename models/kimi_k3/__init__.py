# generated from spec.yaml@0572cac58680, do not edit
"""Kimi K3 (generated; the source of truth is spec.yaml)."""
