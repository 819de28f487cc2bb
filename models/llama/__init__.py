# generated from spec.yaml@8659430fa18c, do not edit
"""Llama (generated; the source of truth is spec.yaml)."""
