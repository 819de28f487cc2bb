"""Support matrix: which features a family's spec uses and which devices can run it."""

from __future__ import annotations

import torch

from dayzero.kernels.registry import KERNELS, OPS
from dayzero.kernels.selection import OpTable, load_plugins
from dayzero.sdk.families import Family, kernel_needs
from dayzero.sdk.spec.assemble import mtp_unbuildable, resolve
from dayzero.sdk.spec.reference import spec_config

DEVICES = ("cpu", "cuda")


def _features(fam: Family) -> list[str]:
    out = []
    for name, opts in fam.spec.blocks.items():
        flags = [
            k
            for k, v in opts.model_dump(exclude_defaults=True).items()
            if k != "kind" and v not in (None, False)
        ]
        out.append(f"{opts.kind} ({name}: {', '.join(flags) or 'plain'})")
    return out


def device_support(fam: Family, groups: tuple | None = None, needs: dict | None = None) -> dict[str, str]:
    """For each device kind: 'yes (backends)' or what is missing, from the kernels' declared
    capabilities (needs: the tiny config's ops, resolved here when not given)."""
    needs = _tiny_needs(fam, groups) if needs is None else needs
    out = {}
    for dev in DEVICES:
        missing, backends = [], set()
        for op, need in needs.items():
            fits = [
                k
                for _, k in KERNELS.items()
                if k.op == op and dev in k.caps.devices and need.features <= k.caps.features
            ]
            if fits:
                backends |= {k.backend for k in fits}
            else:
                missing.append(op)
        out[dev] = f"yes ({', '.join(sorted(backends))})" if not missing else f"no: {', '.join(missing)}"
    return out


def _tiny_needs(fam: Family, groups: tuple | None) -> dict:
    """The ops (and their features) the family's tiny config needs."""
    load_plugins()
    tiny = spec_config(fam.spec.spec, dict(fam.spec.spec.tiny))
    cfg = fam.config(tiny) if groups is None else resolve(fam.spec, tiny, groups, "tiny config")
    return kernel_needs(cfg, OpTable(torch.device("cpu"), torch.float32)).needs()


def packed_support(needs: dict) -> str:
    """Whether packed (quantized) weights can run: every op of `needs` with a packed form has a
    packed kernel for the features needed of it (a SiTU expert needs `situ` of the packed
    experts too)."""
    missing = []
    for op, need in needs.items():
        packed = OPS.get(op).packed
        if packed is None:
            continue
        kernels = [k for _, k in KERNELS.items() if k.op == packed]
        if not any(need.features <= k.caps.features for k in kernels):
            lacks = need.features - frozenset().union(*(k.caps.features for k in kernels))
            missing.append(f"{packed} ({', '.join(sorted(lacks)) or 'these features together'})")
    return "yes: packed in memory" if not missing else f"not yet: no {', '.join(missing)} kernel"


def support_matrix(fam: Family, groups: tuple | None = None) -> list[tuple[str, str]]:
    """groups: the cache geometry to resolve with (codegen passes the one it is rendering)."""
    spec = fam.spec.spec
    needs = _tiny_needs(fam, groups)  # resolved once for both support rows
    rows = [(f, "yes") for f in _features(fam)]
    rows.append(
        (f"residual: {spec.residual.kind}{', depth-scaled' if spec.residual.depth_scaled else ''}", "yes")
    )
    if spec.head.softcap is not None:
        rows.append(("final logit softcap", "yes"))
    rows.append(("quantized checkpoints (nvfp4, mxfp4, fp8_block, mixed)", packed_support(needs)))
    if spec.mtp is not None:
        why = mtp_unbuildable(spec)
        built = (
            f"tensors set aside at load ({why})"
            if why
            else ("built when speculative decoding drafts with it (method mtp); else set aside")
        )
        rows.append((f"MTP head ({spec.mtp.kind})", built))
    rows += [(f"device: {d}", s) for d, s in device_support(fam, groups, needs).items()]
    return rows
