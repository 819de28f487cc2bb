"""A test backend that fails on purpose (loaded through DAYZERO_KERNEL_MODULES=faulty_kernels and
chosen with DAYZERO_KERNEL_ADD_RMS_NORM=faulty): the reference residual add + norm, except that
while the file named by DAYZERO_FAULT_FILE exists every call raises, as a device error would
(with DAYZERO_FAULT_RANK set: only on that torch.distributed rank, the others run as usual)."""

from __future__ import annotations

import os

import torch.distributed as dist

from dayzero.kernels.reference.basic import add_rms_norm
from dayzero.kernels.registry import OPS, Capabilities, register


class InjectedFault(RuntimeError):
    pass


@register("add_rms_norm", "faulty", Capabilities(features=OPS.get("add_rms_norm").features, priority=-1))
def faulty_add_rms_norm(*args, **kw):
    path = os.environ.get("DAYZERO_FAULT_FILE")
    rank = os.environ.get("DAYZERO_FAULT_RANK")
    mine = rank is None or (dist.is_initialized() and dist.get_rank() == int(rank))
    if path and mine and os.path.exists(path):
        raise InjectedFault(f"injected fault ({path} exists)")
    return add_rms_norm(*args, **kw)
