"""The frozen configuration every layer receives (`model`) and the value types spec options are
written in (`options`). Built once at the boundary (sdk/spec resolves a spec against an HF
config); nothing below reads the HF config."""
