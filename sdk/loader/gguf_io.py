"""GGUF through the `gguf` package: metadata -> HF-style config, tensors dequantized to fp32."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from dayzero.sdk.errors import CheckpointError
from dayzero.sdk.loader.gguf_rope import ROPE_FREQS, llama3_from_rope_freqs


def metadata(path: Path) -> dict:
    """The file's key-value metadata (the big tokenizer arrays as their lengths, the only thing
    read from them) and `__tensors__`, the tensor names, read straight from the header."""
    with open(path, "rb") as f:
        try:
            out, infos, _ = _header(f)
        except (struct.error, UnicodeDecodeError, KeyError) as e:
            raise CheckpointError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    out["__tensors__"] = [i[0] for i in infos]
    return out


def hf_config(
    path: Path, mapping: dict[str, str], rope_at: str = "rope_parameters"
) -> tuple[dict, frozenset[str]]:
    """The HF config fields a spec's gguf section names: `{arch}.key` reads metadata,
    `len:key` the length of an array, `tensor_absent:name` whether a tensor is missing; and the
    RoPE scaling the file states, at the config path `rope_at` (the section's `rope_parameters`:
    `rope_parameters`, or a per-layer-type entry such as `rope_parameters.full_attention`).
    Returns the config and the tensors it was read from (they hold no parameter: the loader
    skips them)."""
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
    return cfg, rope_scaling(path, meta, cfg, rope_at)


def rope_scaling(path: Path, meta: dict, cfg: dict, rope_at: str = "rope_parameters") -> frozenset[str]:
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
        *outer, last = rope_at.split(".")
        at = cfg
        for k in outer:
            at = at.setdefault(k, {})
        at[last] = {"rope_theta": theta, **params}
    return read


DEQUANT_ROWS = 2048  # rows dequantized at a time
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def _big(key: str) -> bool:
    return key.startswith("tokenizer.ggml.") and key.endswith(("tokens", "merges", "token_type", "scores"))


def _header(f) -> tuple[dict, list[tuple[str, tuple[int, ...], int, int]], int]:
    """The metadata (big tokenizer arrays as their lengths), (name, GGML dims, GGML type, data
    offset) of every tensor, and where the data starts.

    Reads the header directly (the big arrays are skipped, not materialised), so it holds no mmap
    of the file and no copy of the tokenizer arrays."""

    def u(fmt: str):
        size = struct.calcsize("<" + fmt)
        return struct.unpack("<" + fmt, f.read(size))[0]

    def value(vtype: int, keep: bool = True):
        if vtype == 8:
            n = u("Q")
            return f.read(n).decode() if keep else f.seek(n, 1)
        if vtype == 9:
            etype, n = u("I"), u("Q")
            if keep:
                return [value(etype) for _ in range(n)]
            if etype in _SCALARS:
                f.seek(n * struct.calcsize(_SCALARS[etype]), 1)
            else:
                for _ in range(n):
                    value(etype, keep=False)
            return n
        return u(_SCALARS[vtype])

    if f.read(4) != b"GGUF":
        raise CheckpointError(f"{f.name}: not a GGUF file (bad magic)")
    version, n_tensors, n_kv = u("I"), u("Q"), u("Q")
    meta: dict = {"GGUF.version": version, "GGUF.tensor_count": n_tensors, "GGUF.kv_count": n_kv}
    for _ in range(n_kv):
        key = f.read(u("Q")).decode()
        meta[key] = value(u("I"), keep=not _big(key))
    infos = []
    for _ in range(n_tensors):
        name = f.read(u("Q")).decode()
        dims = tuple(u("Q") for _ in range(u("I")))
        infos.append((name, dims, u("I"), u("Q")))
    alignment = meta.get("general.alignment", 32)
    start = -(-f.tell() // alignment) * alignment
    return meta, infos, start


def _tensor_infos(f) -> tuple[list[tuple[str, tuple[int, ...], int, int]], int]:
    _, infos, start = _header(f)
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
