# generated from spec.yaml@74eadc8e33aa, do not edit
"""VaultGemma (generated; the source of truth is spec.yaml)."""
