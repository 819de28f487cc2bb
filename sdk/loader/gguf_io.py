"""GGUF through the `gguf` package: metadata -> HF-style config, tensors dequantized to fp32."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from dayzero.sdk.loader.safetensors_io import CheckpointError


def _reader(path: Path):
    import gguf

    try:
        return gguf.GGUFReader(path)
    except (ValueError, OSError) as e:
        raise CheckpointError(f"{path}: not a readable GGUF file ({e})") from None


def metadata(path: Path) -> dict:
    r = _reader(path)
    out = {}
    for key, field in r.fields.items():
        if key.startswith("tokenizer.ggml.") and key.endswith(("tokens", "merges", "token_type", "scores")):
            out[key] = len(field.data)  # only the length is ever read from the big arrays
            continue
        out[key] = field.contents()
    out["__tensors__"] = [t.name for t in r.tensors]
    return out


def hf_config(path: Path, mapping: dict[str, str]) -> dict:
    """The HF config fields a spec's gguf section names: `{arch}.key` reads metadata,
    `len:key` the length of an array, `tensor_absent:name` whether a tensor is missing."""
    meta = metadata(path)
    arch = meta.get("general.architecture")
    cfg: dict = {"model_type": arch, "architectures": []}
    for field, src in mapping.items():
        src = src.replace("{arch}", str(arch))
        if src.startswith("tensor_absent:"):
            cfg[field] = src.split(":", 1)[1] not in meta["__tensors__"]
        elif src.startswith("len:"):
            cfg[field] = meta.get(src[4:])
        elif src in meta:
            cfg[field] = meta[src]
    return cfg


def iter_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    import gguf

    for t in _reader(path).tensors:
        try:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise CheckpointError(f"{path}: tensor {t.name}: {e}") from None
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        yield t.name, torch.from_numpy(np.array(arr, dtype=np.float32).reshape(shape))  # a writable copy


def count_tensors(path: Path) -> int:
    return len(_reader(path).tensors)
