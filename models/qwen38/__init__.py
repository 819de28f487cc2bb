# generated from spec.yaml@961e02b7b875, do not edit
"""Qwen3.8 (generated; the source of truth is spec.yaml)."""
