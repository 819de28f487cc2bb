"""dayzero.models: one folder per model family (spec, generated code, model card)."""
