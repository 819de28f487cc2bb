"""`dayzero serve --tensor-parallel-size 2` on CPU ranks (gloo): the server (rank 0) answers the
openai client as one rank does, started alone, as two hosts (--nnodes) or by torchrun; a rank
killed under it ends the server with an error that names the rank, within a bounded time;
SIGTERM drains the server and stops every rank."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from openai import OpenAI
from server_fixture import Server, free_port

from dayzero.sdk.parity.tiny import write_tiny

FLAGS = ("--dtype", "float32", "--kv-cache-memory", "8MiB", "--max-num-seqs", "4", "--served-model-name", "m")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_tiny("beam", tmp_path_factory.mktemp("tp-serve") / "beam", seed=3)


def answers(server) -> list[str]:
    client = OpenAI(base_url=f"{server.url}/v1", api_key="none")
    out = []
    for prompt in ("The quick brown fox", "A tensor-parallel rank"):
        r = client.completions.create(model="m", prompt=prompt, max_tokens=12, temperature=0)
        out.append(r.choices[0].text)
    return out


def rank_pids(server_pid: int) -> list[int]:
    """The spawned rank processes: children of the server started by multiprocessing's spawn."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (d / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == server_pid and b"spawn_main" in cmd and b"resource_tracker" not in cmd:
            pids.append(int(d.name))
    return pids


def test_two_ranks_answer_as_one_and_a_dead_rank_stops_the_server(checkpoint):
    one = Server(str(checkpoint), *FLAGS)
    try:
        want = answers(one)
    finally:
        one.stop()
    two = Server(str(checkpoint), *FLAGS, "--tensor-parallel-size", "2")
    try:
        assert answers(two) == want
        (pid,) = rank_pids(two.proc.pid)
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        code = two.proc.wait(60)
        took = time.monotonic() - t0
        log = two.output()
    finally:
        two.stop()
    assert code == 1, log[-2000:]
    assert took < 30, took
    assert "tensor-parallel rank 1 exited with code -9" in log, log[-2000:]
    assert "Traceback" not in log, log[-3000:]


def test_two_hosts_by_flags_and_torchrun_answer_as_one_and_stop_on_sigterm(checkpoint, tmp_path):
    """--nnodes 2: host 1's `dayzero serve` follows host 0's (both on this machine, one rank
    each); then torchrun starting both ranks. SIGTERM to the server's side drains it, rank 0
    sends the stop and every rank exits 0."""
    one = Server(str(checkpoint), *FLAGS)
    try:
        want = answers(one)
    finally:
        one.stop()
    port = free_port()
    cmd = [sys.executable, "-m", "dayzero.sdk.cli", "serve", str(checkpoint), "--device", "cpu", *FLAGS]
    hosts = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-port", str(port)]
    log = (tmp_path / "host1.log").open("w+")
    host1 = subprocess.Popen(
        [*cmd, *hosts, "--node-rank", "1"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=os.environ | {"PYTHONFAULTHANDLER": "1"},  # an abort prints the Python stacks
    )
    try:
        host0 = Server(str(checkpoint), *FLAGS, *hosts, "--node-rank", "0")
        try:
            assert answers(host0) == want
            host0.proc.send_signal(signal.SIGTERM)
            assert host0.proc.wait(60) == 0, host0.output()[-2000:]
        finally:
            host0.stop()
        assert host1.wait(60) == 0
        log.seek(0)
        assert "stopped by rank 0" in log.read()
    finally:
        if host1.poll() is None:
            host1.kill()
    http = free_port()
    run = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
    torchrun = subprocess.Popen(
        [run, "--nproc-per-node", "2", "--master-port", str(free_port()), "-m", "dayzero.sdk.cli", "serve",
         str(checkpoint), "--device", "cpu", *FLAGS, "--tensor-parallel-size", "2", "--port", str(http)],
        stdout=(tmp_path / "torchrun.log").open("w"), stderr=subprocess.STDOUT, start_new_session=True,
        env=os.environ | {"PYTHONFAULTHANDLER": "1"},
    )  # fmt: skip
    try:
        server = SimpleNamespace(url=f"http://127.0.0.1:{http}")
        deadline = time.monotonic() + 240
        while not _healthy(server.url):
            assert torchrun.poll() is None and time.monotonic() < deadline, (
                tmp_path / "torchrun.log"
            ).read_text()
            time.sleep(0.5)
        assert answers(server) == want
        torchrun.send_signal(signal.SIGTERM)  # torchrun passes it to both ranks, then exits 1 itself
        torchrun.wait(90)
        out = (tmp_path / "torchrun.log").read_text()
        assert "tensor-parallel rank 1: stopped by rank 0" in out, out[-3000:]  # drained, then the stop
        assert "dayzero serve:" not in out, out[-3000:]  # no error of either rank
    finally:
        if torchrun.poll() is None:
            os.killpg(torchrun.pid, signal.SIGKILL)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
