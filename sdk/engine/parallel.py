"""The processes of a tensor-parallel model on torch.distributed: one process a rank (a device:
NCCL on GPUs, gloo on CPUs), started here or by `torchrun`. `run_ranks` starts them on this
host and watches them: a rank that raises or exits ends them all with an error naming it, and
one that hangs past the deadline ends them all the same way, never a silent wait. A rank whose
step fails leaves word in the group's store (`report_failure`), which rank 0 reads to name it.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

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
    timeout = datetime.timedelta(seconds=timeout_s)
    # the store init_method would make (rank 0 serves it; torchrun's agent under torchrun), kept
    store, _, _ = next(dist.rendezvous(f"tcp://{addr}:{port}", rank, size, timeout=timeout))
    store.set_timeout(timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    return TpGroup(size, rank, dist.group.WORLD, store)


class Holder(Protocol):
    def release(self) -> None: ...  # drop the process-group and store handles it keeps


def end_group(*holders: Holder | None) -> None:
    """Destroy this rank's process groups, then drop every handle `holders` keep (TpGroup's group
    and store, the Leader's control group) and collect, so that gloo's process groups and rank
    0's TCPStore server are destroyed here, while the interpreter runs. Left to the interpreter's
    exit, their destruction may abort the process ("terminate called without an active
    exception"): two gloo ranks that keep the handles aborted in 20 of 60 processes (30 runs),
    none in 60 runs that drop them; a served rank 0 at SIGTERM, once in 30 (measured 2026-12-06)."""
    dist.destroy_process_group()
    for h in holders:
        if h is not None:  # (an engine without a Leader: one rank, or a follower)
            h.release()
    gc.collect()


# the store's keys: how many ranks reported a failure, and each report in the order they came
# (the first is the origin: the others fail after it, when its connections close)
_COUNT, _FAILED = "dayzero/failures", "dayzero/failed/{}"


def report_failure(tp: TpGroup, why: str) -> None:
    """Leave word in the group's store that this rank failed, and why (rank 0 names it)."""
    if tp.store is None:
        return
    try:
        tp.store.set_timeout(datetime.timedelta(seconds=5))  # a store gone with rank 0: no long wait
        tp.store.set(_FAILED.format(tp.store.add(_COUNT, 1)), why)
    except Exception as e:  # rank 0 (the store) is gone too: nobody is left to tell
        log.warning("tensor-parallel rank %d could not report its failure: %s", tp.rank, e)


def reported_failure(tp: TpGroup) -> str | None:
    """The first failure a rank reported through the store; None if none (yet)."""
    if tp.store is None:
        return None
    with contextlib.suppress(Exception):  # a store that cannot answer holds nothing to say
        if tp.store.check([_FAILED.format(1)]):
            return tp.store.get(_FAILED.format(1)).decode()
    return None


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
        _end(ctx.processes)


def _end(processes, grace_s: float = 5) -> None:
    """Terminate the processes still running, kill those still running grace_s later (a
    follower ignores SIGTERM: rank 0 acts on it), reap them all."""
    for p in processes:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(5)


@dataclass(frozen=True)
class Launch:
    """Where this process sits among `size` tensor-parallel ranks on `nnodes` hosts (size / nnodes
    a host, vLLM's / SGLang's --nnodes, --node-rank, --master-addr, --master-port): the first
    rank of its host, which starts the host's other ranks, unless `rank` is set (a rank started
    by another process, or by torchrun: `from_env`). Rank 0 (host 0) serves."""

    size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    addr: str = "127.0.0.1"
    port: int | None = None  # None: a free port of this host (one host only)
    rank: int | None = None

    def __post_init__(self) -> None:
        if self.size < 1 or self.nnodes < 1:
            raise ValueError(f"--tensor-parallel-size {self.size}, --nnodes {self.nnodes}: at least 1 each")
        if self.size % self.nnodes:
            raise ValueError(
                f"--tensor-parallel-size {self.size} is not a multiple of --nnodes {self.nnodes}"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} out of --nnodes {self.nnodes}")
        if self.nnodes > 1 and self.port is None:
            raise ValueError("several hosts need --master-port (and --master-addr: host 0's address)")

    @classmethod
    def from_env(cls, size: int, **kw) -> Launch:
        """Under torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment) each
        process is the rank torchrun gave it; otherwise the flags' launch."""
        env = os.environ
        if "RANK" in env and "WORLD_SIZE" in env and "MASTER_PORT" in env:
            world = int(env["WORLD_SIZE"])
            if world != size:
                raise ValueError(f"torchrun started {world} processes for --tensor-parallel-size {size}")
            return cls(
                size,
                addr=env.get("MASTER_ADDR", "127.0.0.1"),
                port=int(env["MASTER_PORT"]),
                rank=int(env["RANK"]),
            )
        return cls(size, **kw)

    @property
    def this_rank(self) -> int:
        return self.node_rank * (self.size // self.nnodes) if self.rank is None else self.rank

    def local_ranks(self) -> list[int]:
        """The ranks this process starts: the rest of its host's (none when `rank` is set)."""
        if self.rank is not None:
            return []
        first = self.this_rank
        return list(range(first + 1, first + self.size // self.nnodes))

    def of(self, rank: int, port: int) -> Launch:
        return replace(self, port=port, rank=rank)


def control_group(timeout_s: float = 7 * 24 * 3600):
    """The gloo group rank 0's plans travel on (ranks.py): host arrays whatever the model's
    backend; its timeout is long, as the other ranks wait on it while the server idles."""
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def watch_parent() -> None:
    """A spawned rank ends itself when the process that started it is gone (killed, crashed):
    no rank outlives its server waiting for plans that never come."""
    parent = os.getppid()

    def check() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=check, name="dayzero-parent-watch", daemon=True).start()


class Followers:
    """The other ranks of this host, spawned by its first rank (on host 0: the server or the
    LLM): entry(index, ranks, *args) runs rank ranks[index]. A watcher thread notices a rank that
    exits before `join` and calls on_failure with a message naming it and its exit code."""

    def __init__(self, entry: Callable, ranks: list[int], args: tuple = ()) -> None:
        self.ranks, self.failed = ranks, None
        self._joining = False
        self.ctx = mp.start_processes(
            entry, args=(ranks, *args), nprocs=len(ranks), join=False, start_method="spawn"
        )

    def exited(self) -> str | None:
        """A message naming the first of the ranks that has exited (None: all run)."""
        for i, p in enumerate(self.ctx.processes):
            if p.exitcode is not None:
                return f"tensor-parallel rank {self.ranks[i]} exited with code {p.exitcode}"
        return None

    def watch(self, on_failure: Callable[[str], None], every_s: float = 0.5) -> None:
        def run() -> None:
            while not self._joining:
                if (why := self.exited()) is not None and not self._joining:
                    self.failed = why
                    log.error("%s; the server stops", why)
                    on_failure(why)
                    return
                time.sleep(every_s)

        threading.Thread(target=run, name="dayzero-rank-watch", daemon=True).start()

    def join(self, timeout_s: float = 30) -> None:
        """Wait for the ranks to end (after rank 0 sent STOP); a rank still running at the
        deadline is killed, named in the log."""
        self._joining = True
        deadline = time.monotonic() + timeout_s
        for i, p in enumerate(self.ctx.processes):
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                log.error(
                    "tensor-parallel rank %d running %.0f s after stop; killed", self.ranks[i], timeout_s
                )
                p.kill()  # it ignores SIGTERM (rank 0's to act on)
                p.join(5)

    def terminate(self, grace_s: float = 2) -> None:
        """End the ranks still running: killed grace_s from now (they ignore SIGTERM, rank 0's
        to act on; a rank whose step failed exits by itself meanwhile)."""
        self._joining = True
        _end(self.ctx.processes, grace_s)
