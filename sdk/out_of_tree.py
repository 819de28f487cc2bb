"""Families whose spec lives outside models/: where their specs are declared, and the one place
their generated modules are imported.

A spec outside models/ comes from one of three sources, each named in the family's `origin`:
- a verb's `--spec PATH` (or `LLM(spec=PATH)`), for that process; `sdk/families.py`
  `register_spec` also lists it in `DAYZERO_SPECS`, so the processes it starts (tensor-parallel
  ranks, a parity run's ranks) register the same families;
- `DAYZERO_SPECS` (spec files or their folders, `os.pathsep`-separated), read when the family
  registry is built;
- the entry-point group `dayzero.families` of an installed package: each entry point names a
  package whose folder holds spec.yaml (`mylab_gemma = mylab.gemma`), or an object that is a
  spec path or a list of them (`mylab = mylab.specs:SPECS`).

`dayzero codegen --spec PATH` writes the generated files next to the spec (model.py, cache.py,
`__init__.py`, README.md, test_parity.py). They are imported by file path, as the package
`dayzero_family_<family>_<hash of the folder>` bound to that folder: nothing is added to
sys.path, and the folder need not be importable under a name of its own.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from types import ModuleType

ENTRY_POINT_GROUP = "dayzero.families"
ENV = "DAYZERO_SPECS"
GENERATED = ("__init__.py", "model.py", "cache.py")  # what building a model imports


class OutOfTreeError(ValueError):
    """A spec outside models/ that cannot be used as declared: its entry point does not load,
    its spec is invalid, its generated files are missing or stale; the message says which."""


@dataclass(frozen=True)
class Source:
    """A spec file outside models/ and where it was declared (said in every error about it)."""

    spec_path: Path
    origin: str


def spec_file(path: str | Path) -> Path:
    """A spec file, or a folder holding spec.yaml, as the absolute path of the file."""
    p = Path(path).expanduser().resolve()
    p = p / "spec.yaml" if p.is_dir() else p
    if not p.is_file():
        raise FileNotFoundError(f"{path}: no spec file (give a spec.yaml or the folder holding one)")
    return p


def env_sources() -> list[Source]:
    paths = [p for p in os.environ.get(ENV, "").split(os.pathsep) if p]
    return [Source(spec_file(p), ENV) for p in paths]


def remember(spec_path: Path) -> None:
    """List a registered spec in DAYZERO_SPECS, for the processes this one starts."""
    paths = [p for p in os.environ.get(ENV, "").split(os.pathsep) if p]
    if str(spec_path) not in paths:
        os.environ[ENV] = os.pathsep.join([*paths, str(spec_path)])


def _package_of(ep: EntryPoint) -> str:
    return ep.dist.name if ep.dist is not None else "(unknown distribution)"


def _paths_of(ep: EntryPoint, target: object) -> list[Path]:
    if isinstance(target, ModuleType):
        if not getattr(target, "__path__", None):
            raise TypeError(f"{target.__name__} is a module, not a package whose folder holds spec.yaml")
        return [Path(next(iter(target.__path__))) / "spec.yaml"]
    if isinstance(target, (str, os.PathLike)):
        return [Path(target)]
    if isinstance(target, Iterable):
        return [Path(t) for t in target]
    raise TypeError(f"{ep.value} is a {type(target).__name__}: name a package, a spec path or a list of them")


def entry_point_sources() -> list[Source]:
    """The specs installed packages declare in `dayzero.families`; an entry point that does not
    load or names no spec file is an error naming its package."""
    out = []
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        origin = f"entry point {ep.name} = {ep.value} of package {_package_of(ep)}"
        try:
            paths = [spec_file(p) for p in _paths_of(ep, ep.load())]
        except Exception as e:  # third-party code: whatever it raises is named with its package
            raise OutOfTreeError(f"{origin}: {type(e).__name__}: {e}") from e
        out += [Source(p, origin) for p in paths]
    return out


def check_generated(folder: Path, spec_hash: str, fix: str) -> None:
    """The generated modules a build imports exist and come from this spec's bytes (their
    first line names the spec's hash); else the error says to run `fix`."""
    for name in GENERATED:
        path = folder / name
        if not path.is_file():
            raise OutOfTreeError(f"{path}: not generated yet: run `{fix}`")
        with path.open() as f:
            first = f.readline()
        if f"spec.yaml@{spec_hash}" not in first:
            raise OutOfTreeError(f"{path}: stale ({first.strip()!r}; spec.yaml is @{spec_hash}): run `{fix}`")


def import_generated(family: str, folder: Path, part: str) -> ModuleType:
    """The family's generated module `part` from folder/<part>.py, in a package bound to the
    folder on first use (named after the folder too: two folders never share one)."""
    package = f"dayzero_family_{family}_{hashlib.sha256(str(folder).encode()).hexdigest()[:8]}"
    if package not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            package, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )
        if spec is None or spec.loader is None:
            raise ImportError(f"{folder}: cannot be imported as the package {package}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[package] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[package]
            raise
    return importlib.import_module(f"{package}.{part}")
