"""The `dayzero` command: help and the scheduler benchmark's output contract."""

from __future__ import annotations

import re
import subprocess
import sys


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dayzero.sdk.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_help_lists_the_verbs():
    r = run("--help")
    assert r.returncode == 0
    assert "bench" in r.stdout


def test_bench_scheduler_prints_a_table_and_the_summary_line():
    r = run("bench", "scheduler", "--sizes", "4,8", "--steps", "30")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    rows = [ln for ln in lines if re.match(r"^\s+(4|8)\s", ln)]
    assert len(rows) == 2
    last = lines[-1]
    assert re.fullmatch(r"scheduler_vs_tokenspeed( (\d+\.\d{3}|n/a)){2}", last), last
    for value in last.split()[1:]:
        if value != "n/a":
            assert 0 < float(value) < 10


def test_unknown_bench_part_is_refused():
    r = run("bench", "nonsense")
    assert r.returncode == 2
    assert "invalid choice" in r.stderr
