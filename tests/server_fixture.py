"""A real `dayzero serve` process on 127.0.0.1 (embedded default), shared by the server tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *flags: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115  (a pipe nobody reads blocks a chatty server)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dayzero.sdk.cli",
                "serve",
                "--port",
                str(self.port),
                "--device",
                "cpu",
                *flags,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            text=True,
            # a fatal signal (an abort at shutdown) prints every Python thread's stack in the log
            env=os.environ | {"PYTHONFAULTHANDLER": "1"} | (env or {}),
        )
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dayzero serve exited: {self.output()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError("dayzero serve did not become healthy in 240 s")

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def metric(self, name: str, labels: str = "") -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith(name + labels + " ") or (not labels and line.startswith(name + " ")):
                return float(line.split()[-1])
        raise KeyError(name)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()
