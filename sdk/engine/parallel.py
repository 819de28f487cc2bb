"""The processes of a tensor-parallel model on torch.distributed: one process a rank (a device:
NCCL on GPUs, gloo on CPUs), started here or by `torchrun`. `run_ranks` starts them on this
host and watches them: a rank that raises or exits ends them all with an error naming it, and
one that hangs past the deadline ends them all the same way, never a silent wait.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from dayzero.kernels.collective import TpGroup

log = logging.getLogger("dayzero.parallel")


class RankError(RuntimeError):
    """A rank failed, exited or hung; the message names it."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(
    size: int,
    rank: int,
    addr: str = "127.0.0.1",
    port: int = 29500,
    device: str = "cpu",
    timeout_s: float = 300,
) -> TpGroup:
    """Join the group (this process is `rank` of `size`); NCCL for CUDA, gloo otherwise. A
    collective that waits longer than timeout_s (a rank died or hangs) raises."""
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend,
        init_method=f"tcp://{addr}:{port}",
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return TpGroup(size, rank, dist.group.WORLD)


def _entry(rank: int, fn: Callable, size: int, port: int, args: tuple) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # ranks share the host's cores
    torch.set_num_threads(1)
    fn(rank, size, port, *args)


def run_ranks(fn: Callable, size: int, args: tuple = (), timeout_s: float = 600) -> None:
    """fn(rank, size, port, *args) in `size` spawned processes (fn importable by name); returns
    when all of them returned, raises RankError naming the first rank that failed or the ranks
    still running at the deadline (every rank is ended then)."""
    port = free_port()
    ctx = mp.start_processes(
        _entry, args=(fn, size, port, args), nprocs=size, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=0.5):
            if time.monotonic() > deadline:
                alive = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
                raise RankError(
                    f"tensor-parallel rank(s) {alive} still running after {timeout_s:.0f} s; ended"
                )
    except ProcessException as e:  # the rank's error (its traceback's last line); the whole one logged
        log.error("tensor-parallel rank %d: %s", e.error_index, e)
        last = next((ln for ln in reversed(str(e).splitlines()) if ln.strip()), "exited")
        raise RankError(f"tensor-parallel rank {e.error_index} failed: {last}") from None
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
        for p in ctx.processes:
            p.join(5)
