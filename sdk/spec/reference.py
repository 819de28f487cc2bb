"""The parity reference: the transformers class a spec names, and its config class."""

from __future__ import annotations

import importlib
import logging


def reference_class(path: str, what: str = "reference class"):
    """`transformers.BeamForCausalLM` -> the class (transformers' lazy top-level import)."""
    module, name = path.rsplit(".", 1)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{what} {path!r} cannot be imported ({e})") from None


def reference_config(path: str, overrides: dict) -> dict:
    """The full HF config dict the reference class builds from `overrides` (defaults filled in)."""
    cls = reference_class(path)
    return _dict(cls.config_class(**overrides), cls.__name__)


def spec_config(spec, overrides: dict) -> dict:
    """The same from a spec: its own config class where it names one (its reference is then not
    imported: a family transformers lacks keeps its reference with the tests), else the
    reference's."""
    if spec.config_class is None:
        return reference_config(spec.reference, overrides)
    return _dict(reference_class(spec.config_class, "config class")(**overrides), spec.architectures[0])


def _dict(cfg, arch: str) -> dict:
    out = cfg.to_dict()
    if not out.get("architectures"):
        out["architectures"] = [arch]
    return out


def merge(base: dict, over: dict) -> dict:
    """`over` on top of `base`, nested mappings merged (a shape may override one sub-config field)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out
