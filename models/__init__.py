"""Model families: one folder each with its spec.yaml, the generated model module, cache
geometry, model card and parity test (`dayzero codegen` writes all but the spec)."""
