"""Triton kernels checked in Triton's CPU interpreter: a test file's checks run in a fresh process
(the interpreter must be chosen before Triton compiles anything), one printed line a check."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable


def index_fix() -> None:
    """Triton 3.6's interpreter turns a scalar tensor into a Python int with int() of a 1-element
    array, which NumPy >= 2.4 refuses; a loop bounded by loaded values (the attention kernel's
    key range) needs it. Take the element instead (the interpreter only: compiled kernels are
    untouched)."""
    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor

    def patched(tensor, scope) -> None:
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


def run_checks(path: str, seed: int, timeout: int = 600) -> list[str]:
    """`python path seed` under the interpreter (the file calls `main` with its checks): the
    non-empty lines it printed; a failing process fails the test with its stderr."""
    env = os.environ | {"TRITON_INTERPRET": "1"}
    r = subprocess.run(
        [sys.executable, path, str(seed)], capture_output=True, text=True, env=env, timeout=timeout
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return [ln for ln in r.stdout.splitlines() if ln.strip()]


def main(check: Callable[[int], list[str]]) -> None:
    """The subprocess side: the index fix, then the checks for argv's seed, a line each."""
    index_fix()
    print("\n".join(check(int(sys.argv[1]))))
