"""How each convention names and shapes a packed weight's tensors in a checkpoint.

F is the float weight's name in the family's weight rules (`...q_proj.weight`); a part of R rows
and K columns (K: unpacked elements) is stored as:

  modelopt   nvfp4      F u8 [R, K/2], F_scale e4m3 [R, K/16], F_scale_2 f32 [], <module>.input_scale f32 []
             mxfp4      F u8 [R, K/2], F_scale u8 [R, K/32]
             fp8_block  F e4m3 [R, K], F_scale f32 [ceil(R/128), ceil(K/128)] (ModelOpt also
                        writes [.., 1, .., 1], and [] for a weight of one block)
  deepseek   fp8_block  F e4m3 [R, K], F_scale_inv f32 [ceil(R/128), ceil(K/128)]
  gpt_oss    mxfp4      F_blocks u8 [R, K/32, 16], F_scales u8 [R, K/32]
  compressed_tensors
             mxfp4      F_packed u8 [R, K/2], F_scale u8 [R, K/32]

`to_rows` turns one such tensor into the per-row component kernels/packed.py stores.
"""

from __future__ import annotations

import math

import torch

from dayzero.kernels.packed import FP8_BLOCK
from dayzero.sdk.config.model import Slice
from dayzero.sdk.errors import WeightError

# convention -> component -> suffix appended to F ("" : F itself; "@input_scale": the module's)
NAMES: dict[str, dict[str, str]] = {
    "modelopt": {"codes": "", "scale": "_scale", "global": "_scale_2", "input": "@input_scale"},
    "deepseek": {"codes": "", "scale": "_scale_inv"},
    "gpt_oss": {"codes": "_blocks", "scale": "_scales"},
    "compressed_tensors": {"codes": "_packed", "scale": "_scale"},
}
CODES_DTYPE = {"nvfp4": torch.uint8, "mxfp4": torch.uint8, "fp8_block": torch.float8_e4m3fn}


def module_of(weight: str) -> str:
    return weight.removesuffix(".weight")


def tensor_name(convention: str, weight: str, component: str) -> str:
    suffix = NAMES[convention][component]
    if suffix.startswith("@"):
        return f"{module_of(weight)}.{suffix[1:]}"
    return weight + suffix


def components(convention: str, fmt: str) -> tuple[str, ...]:
    """The components a convention stores for a format (nvfp4's input scale may be absent)."""
    wanted = {"nvfp4": ("codes", "scale", "global", "input")}.get(fmt, ("codes", "scale"))
    return tuple(c for c in wanted if c in NAMES[convention])


def codes_weight(convention: str, name: str, dtype: torch.dtype) -> str | None:
    """F when `name` is the codes tensor of a packed weight under this convention."""
    suffix = NAMES[convention]["codes"]
    if suffix:
        return name[: -len(suffix)] if name.endswith(suffix) else None
    return name if dtype in (torch.uint8, torch.float8_e4m3fn) else None


def expected_shape(
    convention: str, fmt: str, component: str, rows: int, k: int
) -> tuple[tuple[int, ...], ...]:
    """The shapes a checkpoint may store this component in, for a part of `rows` x `k`."""
    if component in ("global", "input"):
        return ((), (1,))
    if fmt == "fp8_block":
        if component == "codes":
            return ((rows, k),)
        rb, kb = math.ceil(rows / FP8_BLOCK), math.ceil(k / FP8_BLOCK)
        return ((rb, kb), (rb, 1, kb, 1)) + (((),) if rb == kb == 1 else ())  # ModelOpt: [] for one block
    if component == "codes":
        return ((rows, k // 32, 16),) if convention == "gpt_oss" else ((rows, k // 2),)
    return ((rows, k // (16 if fmt == "nvfp4" else 32)),)


def to_rows(fmt: str, component: str, t: torch.Tensor, rows: int) -> torch.Tensor:
    """A checkpoint tensor -> the per-row component [rows, ...] (or [rows] for scalars)."""
    if component in ("global", "input"):
        return t.reshape(()).float().expand(rows)
    if fmt == "fp8_block" and component == "scale":
        t = t[:, 0, :, 0] if t.dim() == 4 else t.reshape(math.ceil(rows / FP8_BLOCK), -1)
        return t.repeat_interleave(FP8_BLOCK, dim=0)[:rows]
    return t.reshape(rows, -1)


# elements of K (columns) one index of a component covers, per format and component
_COLS = {
    ("nvfp4", "codes"): 2, ("mxfp4", "codes"): 2, ("fp8_block", "codes"): 1,
    ("nvfp4", "scale"): 16, ("mxfp4", "scale"): 32, ("fp8_block", "scale"): FP8_BLOCK,
}  # fmt: skip


def _block_scales(t: torch.Tensor) -> torch.Tensor:
    """fp8_block scales as [row blocks, column blocks] (ModelOpt stores [rb, 1, kb, 1])."""
    return t[:, 0, :, 0] if t.dim() == 4 else t


def slice_component(
    convention: str, fmt: str, component: str, t: torch.Tensor, sl: Slice, name: str
) -> torch.Tensor:
    """One tensor-parallel rank's part of a stored component, for the slice `sl` of the float
    weight (sdk/config/model.py): rows split by row (fp8_block scales by whole 128-row blocks),
    columns by the format's blocks (two codes a byte, a scale per 16 / 32 / 128 columns); a
    slice that cuts a block is refused, naming the tensor. Scalars (global, input, a per-tensor
    scale) stay whole."""
    if component in ("global", "input") or t.dim() == 0:
        return t
    if sl.dim == -3:  # experts stacked in one tensor: the expert index leads
        return t.narrow(0, sl.start, sl.length)
    if fmt == "fp8_block" and component == "scale":
        t = _block_scales(t)
    blocked = convention == "gpt_oss" and component == "codes"  # [.., R, K / 32, 16]
    if sl.dim == -2:
        per = FP8_BLOCK if (fmt, component) == ("fp8_block", "scale") else 1
        dim = t.dim() - (3 if blocked else 2)
    else:
        per = 32 if blocked else _COLS[(fmt, component)]
        dim = t.dim() - (2 if blocked else 1)
    end = sl.start + sl.length
    if sl.start % per or (sl.length % per and end != t.shape[dim] * per):
        raise WeightError(
            f"checkpoint tensor {name}: this rank's {'rows' if sl.dim == -2 else 'columns'} "
            f"{sl.start}..{end - 1} cut its {fmt} blocks of {per}; tensor parallelism needs them whole"
        )
    return t.narrow(dim, sl.start // per, -(-sl.length // per))


def take_rows(
    convention: str, fmt: str, component: str, t: torch.Tensor, rows: list[int], name: str
) -> torch.Tensor:
    """A stored component's part for the float weight's rows `rows` (any order: a split by head
    picks runs of rows), each run taken as a tensor-parallel slice is (blocks kept whole), the
    runs joined along the component's row dim. Scalars (global, input, a per-tensor scale) stay
    whole. fp8_block scales: each 128 rows of the part take the scale block of their source
    rows, which must all lie in one block (a part of 32 rows inside a block takes its scale)."""
    if component in ("global", "input") or t.dim() == 0:
        return t
    if (fmt, component) == ("fp8_block", "scale"):
        t = _block_scales(t)
        picks = []
        for j in range(0, len(rows), FP8_BLOCK):
            src = {r // FP8_BLOCK for r in rows[j : j + FP8_BLOCK]}
            if len(src) != 1:
                last = rows[min(j + FP8_BLOCK, len(rows)) - 1]
                raise WeightError(
                    f"checkpoint tensor {name}: a part's rows {rows[j]}..{last} come from several "
                    f"fp8_block blocks of {FP8_BLOCK} rows; their scales cannot be kept"
                )
            picks.append(src.pop())
        return t.index_select(0, torch.tensor(picks, device=t.device))
    runs, start = [], 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or rows[i] != rows[i - 1] + 1:
            runs.append(Slice(-2, rows[start], i - start))
            start = i
    pieces = [slice_component(convention, fmt, component, t, sl, name) for sl in runs]
    blocked = convention == "gpt_oss" and component == "codes"
    return torch.cat(pieces, dim=pieces[0].dim() - (3 if blocked else 2))
