"""The spec: its schema (`schema`), reading a spec file with every check (`read`, `checks`),
the arithmetic of `= expressions` (`expr`), symbols looked up in an HF config (`resolver`), the
frozen ModelConfig assembled from both (`assemble`), the reference class a spec names
(`reference`) and `dayzero new` (`draft`)."""
