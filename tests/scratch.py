"""A test's scratch family: a spec outside models/, its generated model and cache modules
rendered by codegen and run from memory, and tiny checkpoints written through its reference
class (as `dayzero tiny` does for a registered family)."""

from __future__ import annotations

import json
import types
from functools import cached_property
from pathlib import Path

import pytest
import torch
import yaml
from conftest import SEEDS

from dayzero.sdk import codegen
from dayzero.sdk.families import Family
from dayzero.sdk.loader import Checkpoint
from dayzero.sdk.parity.runner import Ours, Reference, make_prompts
from dayzero.sdk.parity.tiny import _randomize
from dayzero.sdk.spec.reference import merge, reference_class

CPU = torch.device("cpu")
SEED = SEEDS[0]  # of the shared tiny checkpoint and its prompts
QWEN2_MOE = Path(__file__).parent / "data" / "qwen2_moe.yaml"  # a test-only spec


def spec_raw(path: Path = QWEN2_MOE) -> dict:
    """A fresh, mutable copy of a spec as parsed YAML."""
    return yaml.safe_load(path.read_text())


class ScratchFamily(Family):
    @cached_property
    def _modules(self) -> dict[str, types.ModuleType]:
        out = {}
        for part, text in codegen.render(self).items():
            if part in ("model.py", "cache.py"):
                mod = types.ModuleType(f"scratch_{self.name}.{part[:-3]}")
                exec(compile(text, str(self.spec_path.parent / part), "exec"), mod.__dict__)
                out[part[:-3]] = mod
        return out

    def module(self, part: str = "model") -> types.ModuleType:
        return self._modules[part]


def scratch_family(raw: dict, tmp: Path) -> ScratchFamily:
    """The spec (parsed YAML) as family raw["family"], in tmp/<family>/spec.yaml."""
    folder = tmp / raw["family"]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "spec.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    return ScratchFamily(raw["family"], folder / "spec.yaml")


def write_checkpoint(fam: Family, out: Path, seed: int, overrides: dict | None = None) -> Path:
    """The spec's tiny config (+ overrides) through the reference class, randomized, saved."""
    fields = merge(dict(fam.spec.spec.tiny), dict(overrides or {}))
    cls = reference_class(fam.spec.spec.reference)
    torch.manual_seed(seed)
    model = cls(cls.config_class(**fields))
    _randomize(model, seed)
    model.save_pretrained(out)
    return out


_TINY: list[Path] = []


def shared_tiny(factory: pytest.TempPathFactory) -> Path:
    """The test spec's tiny Qwen2-MoE checkpoint, written once a session (tests copy it, never
    edit it)."""
    if not _TINY:
        tmp = factory.mktemp("qwen2_moe")
        _TINY.append(write_checkpoint(scratch_family(spec_raw(), tmp), tmp / "ckpt", seed=SEED))
    return _TINY[0]


def checkpoint(fam: Family, folder: Path) -> Checkpoint:
    return Checkpoint(folder, "safetensors", json.loads((folder / "config.json").read_text()), fam)


def max_logit_error(fam: Family, ours_folder: Path, ref_folder: Path, seed: int) -> tuple[float, float]:
    """(max |dayzero - reference| over every position of a few prompts, max |reference logit|):
    dayzero loads `ours_folder` through the spec's rules, the reference `ref_folder`."""
    ours = Ours(checkpoint(fam, ours_folder), CPU, torch.float32)
    ref = Reference(checkpoint(fam, ref_folder), ref_folder, CPU, torch.float32)
    prompts = make_prompts(ours.cfg.embedding.vocab, seed, n=3)
    got = ours.prefill_logits(prompts)
    want = [ref.logits(p) for p in prompts]
    err = max((a - b).abs().max().item() for a, b in zip(got, want, strict=True))
    return err, max(b.abs().max().item() for b in want)
