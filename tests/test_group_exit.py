"""A tensor-parallel rank's exit (sdk/engine/parallel.py `end_group`): the process groups are
destroyed and their handles dropped while the interpreter runs, so that no rank aborts at exit.
Two gloo ranks that kept the handles aborted in 20 of 60 processes ("terminate called without an
active exception"); here 6 runs of two ranks must all exit 0 (with the old exit, 3 of the 6
runs failed in each of two tries)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dayzero.sdk.engine.parallel import free_port

RANK = """
import sys, torch
from dayzero.sdk.engine.parallel import end_group, init_group
tp = init_group(2, int(sys.argv[1]), port=int(sys.argv[2]), timeout_s=60)
x = torch.arange(1000, dtype=torch.float32) * (tp.rank + 1)
for _ in range(20):
    tp.broadcast(x)
assert torch.equal(x, torch.arange(1000, dtype=torch.float32)), "rank 0's values"
end_group(tp)
assert tp.group is None and tp.store is None
"""


@pytest.mark.parametrize("run", range(6))
def test_two_gloo_ranks_exit_cleanly_after_end_group(run: int) -> None:
    port = str(free_port())
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(r), port], stderr=subprocess.PIPE, text=True, env=env
        )
        for r in (1, 0)
    ]
    for p in ranks:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0 and "terminate called" not in err, (p.returncode, err[-2000:])
