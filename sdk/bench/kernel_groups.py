"""Where a profiled step's device time goes, by kind of kernel (`bench decode --profile`).

Each GPU kernel the profiler saw is put in one group: a Triton kernel of ours under the module
that defines it (`triton moe`, `triton mla`, ...: found by name among the JIT functions of
`dayzero.kernels.triton`'s modules), else by its name (first match):
    cuBLAS        gemm / gemv / nvjet / cutlass / xmma / cublas kernels (dense linears, bmm)
    SDPA          flash / fmha / cudnn / efficient-attention kernels (torch's attention)
    NCCL          collectives
    copies        memcpy / memset / cat / copy kernels (casts included)
    other         every other kernel (torch's elementwise, reductions, indexing and sorts; fla-core's)
The table gives each group's device ms and launches a step (totals over the profiled steps
divided by their number), its largest kernels, and the sum: the "where the step goes" tables
of docs/benchmarks.md, made by the bench.
"""

from __future__ import annotations

import re
import types
from dataclasses import dataclass, field

from torch.autograd import DeviceType

from dayzero.kernels import triton as triton_kernels

PATTERNS = (
    ("cuBLAS", re.compile(r"gemm|gemv|nvjet|cutlass|xmma|cublas|splitkreduce", re.I)),
    ("SDPA", re.compile(r"flash|fmha|cudnn|efficient_attention", re.I)),
    ("NCCL", re.compile(r"nccl", re.I)),
    ("copies", re.compile(r"memcpy|memset|copy|catarray", re.I)),
)


def triton_owners() -> dict[str, str]:
    """JIT function name -> `triton <module>` for our Triton kernels (none without triton)."""
    owners = {}
    for mod in vars(triton_kernels).values():
        if isinstance(mod, types.ModuleType) and mod.__name__.startswith(triton_kernels.__name__ + "."):
            for name, obj in vars(mod).items():
                if hasattr(obj, "fn") and hasattr(obj, "run"):  # a @triton.jit function
                    owners[name] = f"triton {obj.fn.__module__.rsplit('.', 1)[-1]}"  # where defined
    return owners


def group_of(kernel: str, owners: dict[str, str]) -> str:
    if kernel in owners:
        return owners[kernel]
    return next((g for g, pat in PATTERNS if pat.search(kernel)), "other")


@dataclass
class Group:
    name: str
    ms: float = 0.0  # device ms a step
    launches: float = 0.0  # a step
    kernels: dict[str, float] = field(default_factory=dict)  # name -> device ms a step


def group_kernels(kernels: list[tuple[str, float, int]], steps: int) -> list[Group]:
    """kernels: (name, device microseconds in total, launches in total) over `steps` steps ->
    the groups, most device time first."""
    owners = triton_owners()
    groups: dict[str, Group] = {}
    for name, us, count in kernels:
        kind = group_of(name, owners)
        g = groups.setdefault(kind, Group(kind))
        ms = us / 1e3 / steps
        g.ms += ms
        g.launches += count / steps
        g.kernels[name] = g.kernels.get(name, 0.0) + ms
    return sorted(groups.values(), key=lambda g: -g.ms)


# the engine's record_function ranges (dayzero.verify, ...): on the GPU a span over its kernels,
# not a kernel
RANGES = "dayzero."


def from_profile(averages, steps: int) -> list[Group]:
    """The groups of a torch.profiler run's key averages (its GPU kernels)."""
    kernels = [
        (e.key, e.self_device_time_total, e.count)
        for e in averages
        if e.device_type == DeviceType.CUDA and not e.key.startswith(RANGES)
    ]
    return group_kernels(kernels, steps)


def table(groups: list[Group], top: int = 3) -> str:
    lines = [f"{'kernels':<16} {'ms a step':>10} {'launches a step':>16}  largest (ms a step)"]
    for g in groups:
        largest = sorted(g.kernels.items(), key=lambda kv: -kv[1])[:top]
        names = ", ".join(f"{n[:40]} {ms:.3f}" for n, ms in largest)
        lines.append(f"{g.name:<16} {g.ms:>10.3f} {g.launches:>16.1f}  {names}")
    total_ms, total_n = sum(g.ms for g in groups), sum(g.launches for g in groups)
    lines.append(f"{'all':<16} {total_ms:>10.3f} {total_n:>16.1f}")
    return "\n".join(lines)
