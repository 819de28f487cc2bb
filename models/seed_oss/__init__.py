# generated from spec.yaml@b71d85231809, do not edit
"""Seed-OSS (generated; the source of truth is spec.yaml)."""
