# generated from spec.yaml@84f70365fe62, do not edit
"""Arcee (generated; the source of truth is spec.yaml)."""
