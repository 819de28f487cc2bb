"""The installed package's top (pkg/dayzero/__init__.py): `from dayzero import LLM, SamplingParams`
gives the API's classes, loaded on first use (a bare `import dayzero` imports no torch), in this
install and in a wheel built from the tree."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

import dayzero
from dayzero.sdk.api import LLM
from dayzero.sdk.engine.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def test_the_top_exports_the_offline_api() -> None:
    from dayzero import LLM as top_llm
    from dayzero import SamplingParams as top_params

    assert top_llm is LLM and top_params is SamplingParams
    assert {"LLM", "SamplingParams"} <= set(dir(dayzero)) and dayzero.__all__ == ["LLM", "SamplingParams"]
    with pytest.raises(AttributeError, match="no attribute 'Engine'"):
        _ = dayzero.Engine


def python(code: str, *flags: str, env: dict | None = None) -> str:
    out = subprocess.run(
        [sys.executable, *flags, "-c", code], capture_output=True, text=True, timeout=300, env=env, cwd="/"
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_a_bare_import_loads_no_engine() -> None:
    got = python("import sys, dayzero; print('torch' in sys.modules, 'dayzero.sdk.api' in sys.modules)")
    assert got.split() == ["False", "False"]


def test_a_wheel_built_from_the_tree_has_the_top(tmp_path: Path) -> None:
    """pip builds the wheel (the C++ extension from the build folder the install left); the
    unpacked wheel alone, without this install's redirect (python -S), answers the import."""
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps", "-w", tmp_path]
    subprocess.run([*build, str(ROOT)], check=True, capture_output=True, timeout=900)
    (wheel,) = tmp_path.glob("dayzero-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        assert {"dayzero/__init__.py", "dayzero/sdk/api.py", "dayzero/sdk/engine/sampling.py"} <= names
        z.extractall(tmp_path / "unpacked")
    deps = sysconfig.get_paths()["purelib"]  # torch and the rest, not this install's dayzero
    code = (
        "import dayzero; from dayzero import LLM, SamplingParams; import dayzero._scheduler;"
        "print(dayzero.__file__, LLM.__module__, SamplingParams.__module__)"
    )
    got = python(code, "-S", env={"PYTHONPATH": f"{tmp_path / 'unpacked'}:{deps}"}).split()
    assert got == [
        str(tmp_path / "unpacked" / "dayzero" / "__init__.py"),
        "dayzero.sdk.api",
        "dayzero.sdk.engine.sampling",
    ]
