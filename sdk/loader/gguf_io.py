"""GGUF through the `gguf` package: metadata -> HF-style config, tensors dequantized to fp32."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from dayzero.sdk.errors import CheckpointError
from dayzero.sdk.loader.gguf_rope import ROPE_FREQS, llama3_from_rope_freqs


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


def hf_config(path: Path, mapping: dict[str, str]) -> tuple[dict, frozenset[str]]:
    """The HF config fields a spec's gguf section names: `{arch}.key` reads metadata,
    `len:key` the length of an array, `tensor_absent:name` whether a tensor is missing; and the
    RoPE scaling the file states (`rope_parameters`). Returns the config and the tensors it was read
    from (they hold no parameter: the loader skips them)."""
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
    return cfg, rope_scaling(path, meta, cfg)


def rope_scaling(path: Path, meta: dict, cfg: dict) -> frozenset[str]:
    """llama.cpp's RoPE scaling as HF `rope_parameters` in cfg: `{arch}.rope.scaling.type` none
    (nothing) or linear (absent: linear, as llama.cpp reads it) with `{arch}.rope.scaling.factor`
    (or the older `rope.scale_linear`); the llama3 scaling from the tensor `rope_freqs.weight`
    (sdk/loader/gguf_rope.py). Any other scaling type is refused, naming the key. Returns the
    tensors read."""
    arch = meta.get("general.architecture")
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))  # llama.cpp's default
    key = f"{arch}.rope.scaling.type"
    kind = str(meta.get(key, "linear"))
    params = None
    if kind == "linear":
        factor = meta.get(f"{arch}.rope.scaling.factor", meta.get(f"{arch}.rope.scale_linear"))
        if factor not in (None, 0, 1):
            params = {"rope_type": "linear", "factor": float(factor)}
    elif kind != "none":
        raise CheckpointError(
            f"{path}: metadata {key} = {kind!r} is not read yet (GGUF RoPE scaling read: none, "
            f"linear, and llama3 as the tensor {ROPE_FREQS})"
        )
    read: frozenset[str] = frozenset()
    if ROPE_FREQS in meta["__tensors__"]:
        divisors = read_tensor(path, ROPE_FREQS)
        rot = meta.get(f"{arch}.rope.dimension_count") or meta.get(f"{arch}.attention.key_length")
        if rot is None and meta.get(f"{arch}.attention.head_count"):
            rot = int(meta.get(f"{arch}.embedding_length", 0)) // int(meta[f"{arch}.attention.head_count"])
        if rot is not None and divisors.numel() != int(rot) // 2:
            raise CheckpointError(
                f"{path}: tensor {ROPE_FREQS} has {divisors.numel()} entries; "
                f"{rot} rotary dims need {int(rot) // 2}"
            )
        if params is not None:
            raise CheckpointError(
                f"{path}: tensor {ROPE_FREQS} and {kind} RoPE scaling (factor {params['factor']}) together "
                "are not read"
            )
        original = meta.get(f"{arch}.rope.scaling.original_context_length")
        try:
            params = llama3_from_rope_freqs(divisors, theta, original, str(path))
        except ValueError as e:
            raise CheckpointError(str(e)) from None
        read = frozenset({ROPE_FREQS})
    if params is not None:
        cfg["rope_parameters"] = {"rope_theta": theta, **params}
    return read


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


def _read(f, path: Path, start: int, info: tuple[str, tuple[int, ...], int, int]) -> torch.Tensor:
    """One tensor read into its own buffer and dequantized to fp32 [rows, ne0] (HF order)."""
    import gguf

    name, dims, gtype, offset = info
    qtype = gguf.GGMLQuantizationType(gtype)
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    n = int(np.prod(dims))
    nbytes = n // block * type_size
    if start + offset + nbytes > path.stat().st_size:
        raise CheckpointError(f"{path}: tensor {name}: data runs past the end of the file (truncated?)")
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
    del raw, rows
    return torch.from_numpy(out.reshape(tuple(reversed(dims))))  # GGML: fastest dim first


def iter_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor dequantized to fp32 [rows, ne0] (HF order); one tensor's buffers alive at a time."""
    with open(path, "rb") as f:
        infos, start = _tensor_infos(f)
        for info in infos:
            yield info[0], _read(f, path, start, info)


def read_tensor(path: Path, name: str) -> torch.Tensor | None:
    """One tensor by name (fp32, HF order); None when the file has none of that name."""
    with open(path, "rb") as f:
        infos, start = _tensor_infos(f)
        info = next((i for i in infos if i[0] == name), None)
        return None if info is None else _read(f, path, start, info)


def count_tensors(path: Path) -> int:
    with open(path, "rb") as f:
        return len(_tensor_infos(f)[0])
