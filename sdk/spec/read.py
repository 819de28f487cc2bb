"""Reading a spec file: YAML -> the validated `Spec` and each block's options (by the block
library's option schemas), then the cross-field checks (`checks`). Every error names the file,
the field path and what was expected."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import BaseModel, ValidationError

from dayzero.kernels.registry import UnknownKeyError
from dayzero.sdk.blocks import BLOCKS
from dayzero.sdk.errors import SpecError
from dayzero.sdk.spec.checks import (
    check_layers,
    check_reference_modules,
    check_symbols,
    check_transforms,
    check_weight_scopes,
)
from dayzero.sdk.spec.schema import Spec


@dataclass(frozen=True)
class LoadedSpec:
    spec: Spec
    blocks: dict[str, BaseModel]  # block name -> validated options of its kind
    path: Path
    hash: str  # of the spec file's bytes

    @property
    def folder(self) -> Path:
        return self.path.parent


_BRANCHES = {
    "int",
    "float",
    "bool",
    "str",
    "constrained-str",
    "list[str]",
    "Release",  # release: one checkpoint or a list of them
    "list[Release]",
}


def _loc(loc: tuple) -> str:
    """A field path without pydantic's union-branch names (`heads.int` -> `heads`)."""
    return ".".join(str(x) for x in loc if str(x) not in _BRANCHES)


def _raise_validation(source: str, prefix: str, err: ValidationError) -> None:
    errors = err.errors()
    first = _loc(errors[0]["loc"])
    same = [e for e in errors if _loc(e["loc"]) == first]  # one field, several union branches
    if len(same) > 1 and any("pattern" in e["msg"] for e in same):
        kinds = [str(e["loc"][-1]) for e in same if str(e["loc"][-1]) in ("int", "float", "bool")]
        msg = f"expected {' or '.join(kinds) or 'a value'} or a `$symbol` reference, got {same[0]['input']!r}"
    else:
        msg = same[0]["msg"]
    rest = len({_loc(e["loc"]) for e in errors}) - 1
    more = f" (and {rest} more)" if rest else ""
    path = f"{prefix}{'.' if prefix and first else ''}{first}"
    raise SpecError(source, path, f"{msg}{more}") from None


def load_spec(path: str | Path) -> LoadedSpec:
    path = Path(path)
    source = str(path)
    raw_bytes = path.read_bytes()
    try:
        raw = yaml.safe_load(raw_bytes)
    except yaml.YAMLError as e:
        raise SpecError(source, "", f"not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise SpecError(source, "", f"expected a mapping at the top level, got {type(raw).__name__}")
    try:
        spec = Spec.model_validate(raw)
    except ValidationError as e:
        _raise_validation(source, "", e)
    blocks: dict[str, BaseModel] = {}
    for name, body in spec.blocks.items():
        if not isinstance(body, dict) or "kind" not in body:
            raise SpecError(source, f"blocks.{name}", "expected a mapping with a `kind`")
        try:
            bdef = BLOCKS.get(str(body["kind"]))
        except UnknownKeyError as e:
            raise SpecError(source, f"blocks.{name}.kind", str(e)) from None
        try:
            blocks[name] = bdef.options.model_validate(body)
        except ValidationError as e:
            _raise_validation(source, f"blocks.{name}", e)
    check_layers(source, spec, blocks)
    check_transforms(source, spec)
    check_weight_scopes(source, spec)
    check_reference_modules(source, spec)
    check_symbols(source, spec, raw)
    return LoadedSpec(spec, blocks, path, hashlib.sha256(raw_bytes).hexdigest()[:12])
