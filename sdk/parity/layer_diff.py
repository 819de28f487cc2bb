"""The layer-by-layer diff `dayzero parity` prints on a failure: the embedding, then every
layer's attention, mlp and output hooked on both sides for one prompt; the first whose max
|diff| exceeds the tolerance (relative to its scale, when that is above 1) is named.

The reference's modules come from the spec's `reference_modules` (a path per role, or per block
of a role: each layer is hooked at its own block's path); its embedding is
`get_input_embeddings()`, so a wrong embedding is blamed on the embedding, not on layer 0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from dayzero.sdk.spec.schema import ReferenceModules

ROLES = (("attention", "attn"), ("mlp", "mlp"), ("layer", None))  # (spec role, dayzero submodule)


def _keep(got: dict[str, list[torch.Tensor]], key: str) -> Callable:
    """A forward hook appending the module's output, flat in token order (dayzero prefills a prompt
    in chunks; residual streams are [T, N, D] in dayzero and may be [B, T, N D] in the reference)."""

    def hook(_m, _i, out):
        t = out[0] if isinstance(out, tuple) else out
        got.setdefault(key, []).append(t.detach().float().reshape(-1))

    return hook


def layer_diff(
    ours: nn.Module,
    ref: nn.Module,
    run: Callable[[], object],
    mods: ReferenceModules,
    plan: Sequence[tuple[str, str]],
    kinds: Sequence[tuple[str, str]],
    tol: float,
) -> list[str]:
    """ours / ref: the two models; run: both forward passes over one prompt (dayzero's in
    chunks: their rows are concatenated); plan: each layer's (attention block, mlp block)
    names; kinds: their block kinds (for the lines)."""
    got: dict[str, list[torch.Tensor]] = {}
    hooks = [
        ref.get_input_embeddings().register_forward_hook(_keep(got, "ref.embedding")),
        ours.embed.register_forward_hook(_keep(got, "ours.embedding")),
    ]
    layers_hooked = False
    for i, (attn, mlp) in enumerate(plan):
        for role, ours_name in ROLES:
            path = mods.path(role, {"attention": attn, "mlp": mlp}.get(role, ""), i)
            if path is None:
                continue
            layers_hooked = True
            hooks.append(ref.get_submodule(path).register_forward_hook(_keep(got, f"ref.{i}.{role}")))
            sub = ours.layers[i] if ours_name is None else getattr(ours.layers[i], ours_name)
            hooks.append(sub.register_forward_hook(_keep(got, f"ours.{i}.{role}")))
    try:
        run()
    finally:
        for h in hooks:
            h.remove()

    def err(key: str) -> tuple[float, bool]:
        """(max |diff|, over the tolerance) of one hooked output."""
        a, b = torch.cat(got[f"ours.{key}"]), torch.cat(got[f"ref.{key}"])
        if a.shape != b.shape:
            raise ValueError(
                f"layer diff: {key}'s output has {a.numel()} values here, {b.numel()} in the reference"
            )
        e = (a - b).abs().max().item()
        return e, e > tol * max(1.0, b.abs().max().item())

    e, bad = err("embedding")
    lines = [f"  {'embedding':<19} (embedding) max|diff| {e:.3e}"]
    if bad:
        return [*lines, "  first divergence: the embedding"]
    if not layers_hooked:
        return [*lines, "  (the spec names no reference_modules: the layers are not compared)"]
    for i in range(len(plan)):
        for role, _ in ROLES:
            if f"ref.{i}.{role}" not in got:
                continue
            kind = {"attention": kinds[i][0], "mlp": kinds[i][1]}.get(role, "decoder layer")
            e, bad = err(f"{i}.{role}")
            lines.append(f"  layer {i:>3} {role:<9} ({kind}) max|diff| {e:.3e}")
            if bad:
                return [*lines, f"  first divergence: layer {i} {role} ({kind} block)"]
    return [*lines, "  no layer exceeds the tolerance: the divergence is in the final norm or head"]
