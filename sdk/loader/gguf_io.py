"""GGUF through the `gguf` package: metadata -> HF-style config, tensors dequantized to fp32."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from dayzero.sdk.errors import CheckpointError


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


DEQUANT_ROWS = 2048  # rows dequantized at a time
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def _tensor_infos(f) -> tuple[list[tuple[str, tuple[int, ...], int, int]], int]:
    """(name, GGML dims, GGML type, data offset) of every tensor, and where the data starts.

    Reads the header directly (the key-value section is skipped, not materialised), so iterating
    tensors holds no mmap of the file and no copy of the tokenizer arrays."""

    def u(fmt: str):
        size = struct.calcsize("<" + fmt)
        return struct.unpack("<" + fmt, f.read(size))[0]

    def skip_value(vtype: int) -> None:
        if vtype == 8:
            f.seek(u("Q"), 1)
        elif vtype == 9:
            etype, n = u("I"), u("Q")
            if etype in _SCALARS:
                f.seek(n * struct.calcsize(_SCALARS[etype]), 1)
            else:
                for _ in range(n):
                    skip_value(etype)
        else:
            f.seek(struct.calcsize(_SCALARS[vtype]), 1)

    if f.read(4) != b"GGUF":
        raise CheckpointError(f"{f.name}: not a GGUF file (bad magic)")
    u("I")  # version
    n_tensors, n_kv = u("Q"), u("Q")
    alignment = 32
    for _ in range(n_kv):
        key = f.read(u("Q")).decode()
        vtype = u("I")
        if key == "general.alignment" and vtype == 4:
            alignment = u("I")
        else:
            skip_value(vtype)
    infos = []
    for _ in range(n_tensors):
        name = f.read(u("Q")).decode()
        dims = tuple(u("Q") for _ in range(u("I")))
        infos.append((name, dims, u("I"), u("Q")))
    start = -(-f.tell() // alignment) * alignment
    return infos, start


def iter_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor read into its own buffer and dequantized to fp32 [rows, ne0] (HF order)."""
    import gguf

    size = path.stat().st_size
    with open(path, "rb") as f:
        infos, start = _tensor_infos(f)
        for name, dims, gtype, offset in infos:
            qtype = gguf.GGMLQuantizationType(gtype)
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            n = int(np.prod(dims))
            nbytes = n // block * type_size
            if start + offset + nbytes > size:
                raise CheckpointError(
                    f"{path}: tensor {name}: data runs past the end of the file (truncated?)"
                )
            raw = np.empty(nbytes, dtype=np.uint8)
            f.seek(start + offset)
            f.readinto(memoryview(raw))
            rows = raw.reshape(-1, dims[0] // block * type_size)  # [rows, bytes per row]
            out = np.empty((rows.shape[0], dims[0]), dtype=np.float32)
            try:
                for i in range(0, rows.shape[0], DEQUANT_ROWS):  # bounded temporaries
                    out[i : i + DEQUANT_ROWS] = gguf.quants.dequantize(rows[i : i + DEQUANT_ROWS], qtype)
            except NotImplementedError as e:
                raise CheckpointError(f"{path}: tensor {name}: {e}") from None
            yield name, torch.from_numpy(out.reshape(tuple(reversed(dims))))  # GGML: fastest dim first
            del raw, rows, out  # before the next allocation: one tensor's buffers alive at a time


def count_tensors(path: Path) -> int:
    with open(path, "rb") as f:
        return len(_tensor_infos(f)[0])
