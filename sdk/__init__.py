"""dayzero.sdk: spec, codegen, loader, execution plane, server and CLI."""
