"""fla-core backend (CUDA): Kimi delta attention (`kda_recurrence`) and the gated delta rule
(`gated_delta_rule`) through flash-linear-attention's Triton kernels (`fla-core==0.6.0`, the `gpu`
extra): `chunk_kda` / `fused_recurrent_kda` and `chunk_gated_delta_rule` /
`fused_recurrent_gated_delta_rule`. Registered only where `fla` imports and CUDA is available.

The same recurrences as the reference ops (kernels/reference/linear_attention.py), per value head:
    S'_t = diag(exp(g_t)) S_{t-1} (KDA: g_t [Dk]; gated delta rule: one scalar g_t)
    S_t = S'_t + k_t (beta_t (v_t - S'_t^T k_t))^T,  o_t = S_t^T q_t  (q, k l2-normed, q / sqrt(Dk))
Layouts, dayzero -> fla:
    q, k [T, H, Dk], v [T, HV, Dv]          -> [1, T', H, D]: one flat batch of the step's rows
    g [T, HV, Dk] (KDA) / [T, HV], log decays -> [1, T', HV(, Dk)], natural-log space as fla takes
                                                it (use_gate_in_kernel off: the block made g)
    beta [T, HV]                            -> [1, T', HV] (already sigmoid-ed)
    rows (StateMeta.query_start_cpu)        -> cu_seqlens [N + 1] int64 over the N non-empty rows
                                                (and cu_seqlens_cpu, so fla plans its chunks
                                                without reading the device)
    state [slots, HV, Dk, Dv] fp32          -> initial_state [N, HV, Dk, Dv] fp32: the rows' slots
                                                gathered, zeros for a row starting at position 0;
                                                Dk-first as fla's default (state_v_first off: no
                                                transpose); the final state scattered back
    l2norm (eps 1e-6) and the Dk^-0.5 scale -> use_qk_l2norm_in_kernel=True, scale=Dk^-0.5
A step whose rows all have one token (decode) runs the fused recurrent kernel, any other the
chunked one (the recurrent one when `chunked` is False).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch

import dayzero.kernels.ops  # noqa: F401  (declares the ops this backend registers)
from dayzero.kernels.registry import Capabilities, register

# fla imports triton and needs a GPU for its kernels: without either, this backend registers
# nothing. The kernels' module is looked for, not a top-level `fla` (any folder of that name on
# the path is a namespace package)
HAVE_FLA = (
    importlib.util.find_spec("fla") is not None
    and importlib.util.find_spec("fla.ops") is not None
    and torch.cuda.is_available()
)
if HAVE_FLA:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    from fla.ops.kda import chunk_kda, fused_recurrent_kda

MAX_KEY_DIM = 256  # fla's chunked kernels take key heads up to 256


@dataclass(frozen=True)
class Rows:
    """A step's non-empty rows as fla's variable-length batch."""

    cu_seqlens: torch.Tensor  # [N + 1] int64 on the device: token offsets from `start`
    cu_seqlens_cpu: torch.Tensor  # the same on the host
    slots: torch.Tensor  # [N] int64: each row's state slot
    fresh: torch.Tensor  # [N] bool: the row starts at position 0 (zero initial state)
    start: int  # the rows' tokens are [start, end) of the step's
    end: int
    decode: bool  # every row one token


_last: list = [None, None]  # (meta, Rows) of the last call: the step's layers share one copy


def rows_of(meta, device: torch.device) -> Rows | None:
    """The rows of `meta` (StateMeta: slots_cpu, has_initial_state_cpu, query_start_cpu) that have
    tokens, as one host-to-device copy (pinned on CUDA); None when no row has any."""
    if _last[0] is meta and _last[1].slots.device == device:
        return _last[1]
    qs, keep = meta.query_start_cpu, []
    for r in range(len(qs) - 1):
        if qs[r + 1] > qs[r]:
            keep.append(r)
    if not keep:
        return None
    start = qs[keep[0]]
    cu = [qs[r] - start for r in keep] + [qs[keep[-1] + 1] - start]
    n = len(keep)
    flat = torch.tensor(
        [*cu, *(meta.slots_cpu[r] for r in keep), *(int(not meta.has_initial_state_cpu[r]) for r in keep)],
        dtype=torch.int64,
    )
    cu_cpu = flat[: n + 1]
    pinned = device.type == "cuda"
    flat = (flat.pin_memory() if pinned else flat).to(device, non_blocking=pinned)
    slots, fresh = flat[n + 1 : 2 * n + 1], flat[2 * n + 1 :].bool()
    rows = Rows(flat[: n + 1], cu_cpu, slots, fresh, start, start + cu[-1], decode=cu[-1] == n)
    _last[:] = [meta, rows]
    return rows


def initial_states(state: torch.Tensor, rows: Rows) -> torch.Tensor:
    """state [slots, HV, Dk, Dv] fp32 -> the rows' states [N, HV, Dk, Dv], zeros for fresh rows
    (whatever a fresh row's slot held, NaN included, is not read)."""
    s = state.index_select(0, rows.slots)
    return s.masked_fill(rows.fresh[:, None, None, None], 0.0)


def store_states(state: torch.Tensor, rows: Rows, final: torch.Tensor) -> None:
    """final [N, HV, Dk, Dv] -> the rows' slots of state, in place."""
    state.index_copy_(0, rows.slots, final.to(state.dtype))


def bind(op: str, chunk: Callable, recurrent: Callable) -> Callable:
    """The dayzero op `op` (kda_recurrence or gated_delta_rule: q, k, v, g, beta, state, meta,
    chunked) over fla-style kernels `chunk` / `recurrent` (fla's signatures: [B, T, H, D] inputs,
    initial_state, output_final_state, use_qk_l2norm_in_kernel, scale, cu_seqlens)."""

    def run(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
        meta,
        chunked: bool = True,
    ) -> torch.Tensor:
        if q.shape[-1] > MAX_KEY_DIM:
            raise ValueError(f"{op}/fla: key head size {q.shape[-1]} > {MAX_KEY_DIM} (fla's limit)")
        out = torch.zeros_like(v)  # [T, HV, Dv]
        rows = rows_of(meta, q.device)
        if rows is None:
            return out
        use_chunk = chunked and not rows.decode
        extra = {"cu_seqlens_cpu": rows.cu_seqlens_cpu} if use_chunk else {}
        # by name: fused_recurrent_gated_delta_rule's fifth parameter is gk, not beta
        flat = {n: x[rows.start : rows.end].unsqueeze(0) for n, x in zip("qkvg", (q, k, v, g), strict=True)}
        o, final = (chunk if use_chunk else recurrent)(
            **flat,
            beta=beta[rows.start : rows.end].unsqueeze(0),
            scale=q.shape[-1] ** -0.5,
            initial_state=initial_states(state, rows),
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
            cu_seqlens=rows.cu_seqlens,
            **extra,
        )
        out[rows.start : rows.end] = o[0].to(v.dtype)
        store_states(state, rows, final)
        return out

    run.__name__ = run.__qualname__ = f"{op}_fla"
    run.__doc__ = f"{op} through fla-core's kernels (layouts: see dayzero.kernels.fla)."
    return run


if HAVE_FLA:
    # Not graph-safe (yet): `rows_of` builds the rows from the host copies and moves them with a
    # copy from a fresh pinned tensor each step, and fla's own kernels' capture is unchecked.
    # A model with these kernels decodes eagerly under `auto`; DAYZERO_KERNEL_KDA_RECURRENCE=batched
    # (or ..._GATED_DELTA_RULE) selects the graph-safe torch decode step instead.
    _caps = Capabilities(
        devices=frozenset({"cuda"}),
        features=frozenset({"chunked"}),
        min_capability=(8, 0),
        priority=10,
        graphs=False,
    )
    register("kda_recurrence", "fla", _caps)(bind("kda_recurrence", chunk_kda, fused_recurrent_kda))
    register("gated_delta_rule", "fla", _caps)(
        bind("gated_delta_rule", chunk_gated_delta_rule, fused_recurrent_gated_delta_rule)
    )
