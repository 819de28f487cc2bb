"""Safetensors read tensor by tensor: one file or shards with an index.

The header is parsed and checked here (dtype, shape x itemsize == bytes, data inside the file)
so a truncated or corrupt file fails naming the tensor. Each tensor is read into its own buffer
and handed out; nothing else is held, so peak memory is the model plus the largest tensor. A
tensor-parallel rank keeps only its slice of each tensor and reads nothing of the experts other
ranks hold (`want`).
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from dayzero.sdk.config.model import Slice
from dayzero.sdk.errors import CheckpointError

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute file offsets
    end: int


def read_header(path: Path) -> list[TensorInfo]:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: {size} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise CheckpointError(f"{path}: header of {n} bytes runs past the end of the file ({size} bytes)")
        try:
            header = json.loads(f.read(n))
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path}: header is not valid JSON ({e})") from None
    out = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dt = meta.get("dtype")
        if dt not in DTYPES:
            raise CheckpointError(f"{path}: tensor {name}: unknown dtype {dt!r}")
        shape = tuple(int(x) for x in meta["shape"])
        b, e = (int(x) for x in meta["data_offsets"])
        nbytes = math.prod(shape) * DTYPES[dt].itemsize
        if e - b != nbytes:
            raise CheckpointError(f"{path}: tensor {name}: {e - b} bytes for shape {list(shape)} of {dt}")
        if 8 + n + e > size:
            raise CheckpointError(
                f"{path}: tensor {name}: data ends at byte {8 + n + e} but the file has {size} (truncated?)"
            )
        out.append(TensorInfo(name, dt, shape, 8 + n + b, 8 + n + e))
    return sorted(out, key=lambda t: t.begin)


def shard_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
        for f in files:
            if not (folder / f).exists():
                raise CheckpointError(f"{index}: shard {f} is missing")
        listed = {name for f in files for name in (t.name for t in read_header(folder / f))}
        if missing := sorted(set(weight_map) - listed):
            raise CheckpointError(f"{index}: tensors listed but in no shard: {', '.join(missing[:8])}")
        return [folder / f for f in files]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors files")
    return files


# what a reader wants of a tensor (name, shape): None nothing (not read at all), True all of it,
# a Slice (sdk/config/model.py) that part of it only
Want = Callable[[str, tuple[int, ...]], "Slice | bool | None"]


CHUNK_BYTES = 8 << 20  # an inner-dim slice is read through a buffer of this many bytes of whole rows


def _read_into(f, buf: torch.Tensor, offset: int, what: str) -> None:
    f.seek(offset)
    if f.readinto(memoryview(buf.numpy())) != buf.numel():
        raise CheckpointError(f"{f.name}: tensor {what}: short read (file changed while loading?)")


def _read_slice(f, t: TensorInfo, sl: Slice) -> torch.Tensor:
    """One rank's part of a tensor: rows of the leading dim as one contiguous read; a slice of
    an inner dim through a bounded buffer of whole leading rows (the file is read in full, only
    the slice is kept)."""
    dt, dim = DTYPES[t.dtype], len(t.shape) + sl.dim
    row = math.prod(t.shape[1:]) * dt.itemsize  # bytes of one leading index
    if dim == 0:
        buf = torch.empty(sl.length * row, dtype=torch.uint8)
        _read_into(f, buf, t.begin + sl.start * row, t.name)
        return buf.view(dt).reshape(sl.length, *t.shape[1:])
    out = torch.empty(*t.shape[:dim], sl.length, *t.shape[dim + 1 :], dtype=dt)
    step = max(1, CHUNK_BYTES // max(row, 1))
    for r0 in range(0, t.shape[0], step):
        n = min(step, t.shape[0] - r0)
        buf = torch.empty(n * row, dtype=torch.uint8)
        _read_into(f, buf, t.begin + r0 * row, t.name)
        out[r0 : r0 + n] = buf.view(dt).reshape(n, *t.shape[1:]).narrow(dim, sl.start, sl.length)
    return out


def iter_tensors(files: list[Path], want: Want | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor (or what `want` asks of each: skipped ones are never read)."""
    for path in files:
        infos = read_header(path)  # a short or corrupt file fails here, named
        with open(path, "rb") as f:
            for t in infos:
                part = True if want is None else want(t.name, t.shape)
                if part is None:
                    continue
                if part is not True:
                    yield t.name, _read_slice(f, t, part)
                    continue
                buf = torch.empty(t.end - t.begin, dtype=torch.uint8)
                _read_into(f, buf, t.begin, t.name)
                yield t.name, buf.view(DTYPES[t.dtype]).reshape(t.shape)
                del buf  # before the next allocation: one tensor's buffer alive at a time


def count_tensors(files: list[Path]) -> int:
    return sum(len(read_header(f)) for f in files)
