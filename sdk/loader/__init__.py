"""Checkpoints: find the format and family, resolve the config, stream the weights in strictly."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from dayzero.sdk.errors import CheckpointError, WeightError
from dayzero.sdk.families import FAMILIES, Family, family_for, family_for_gguf
from dayzero.sdk.loader import gguf_io, safetensors_io
from dayzero.sdk.loader.mapping import Mapping, Split, StrictWriter
from dayzero.sdk.quant.config import QuantConfig, read_quant_config
from dayzero.sdk.quant.packing import Packing, find_packing
from dayzero.sdk.spec.assemble import layer_plan
from dayzero.sdk.spec.reference import merge
from dayzero.sdk.spec.resolver import Resolver

log = logging.getLogger(__name__)

__all__ = [
    "LOAD_FORMATS",
    "Checkpoint",
    "CheckpointError",
    "WeightError",
    "fill_dummy",
    "load_weights",
    "open_checkpoint",
    "open_mtp_head",
    "refuse_dummy",
]


@dataclass(frozen=True)
class Checkpoint:
    path: Path  # the folder (safetensors) or the .gguf file
    format: str  # "safetensors" | "gguf"
    hf: dict  # HF config fields
    family: Family
    quant: QuantConfig | None = None
    # tensors the config was read from (GGUF: rope_freqs.weight, the llama3 RoPE scaling), checked
    # then; they hold no parameter, and load_weights passes over them
    config_tensors: frozenset[str] = frozenset()

    @property
    def folder(self) -> Path:
        return self.path if self.path.is_dir() else self.path.parent

    @cached_property
    def mapping(self) -> Mapping:
        """The family's weight rules for this checkpoint's format and config; the MTP layers'
        tensors (the spec's `mtp` patterns) set aside."""
        return self._mapping(mtp=False)

    @cached_property
    def mtp_mapping(self) -> Mapping:
        """The same with the NextN layer built (speculative decoding with method mtp): decoder
        layer L's tensors load by the layers' rules into `mtp.layer.*`, the spec's rules for its
        own tensors (enorm, hnorm, eh_proj, the shared head's norm) into `mtp.*`; none aside."""
        return self._mapping(mtp=True)

    def _mapping(self, mtp: bool) -> Mapping:
        fam = self.family
        fmt = next((w for w in fam.spec.spec.weights if w.format == self.format), None)
        if fmt is None:
            raise CheckpointError(f"family {fam.name} has no weight rules for {self.format}")
        resolver = Resolver(fam.spec, self.hf, str(self.path))
        spec_mtp = fam.spec.spec.mtp
        plan = layer_plan(fam.spec.spec, resolver, mtp)  # block-scoped rules match a layer's blocks
        n = len(plan) - mtp
        if mtp:  # the NextN layer is layer n by the layers' rules (sdk/spec/assemble.py)
            unused = fmt.model_copy(update={"mtp": fmt.mtp_unused})  # set aside even when built
            renames = {f"layers.{n}.": "mtp.layer."}
            alias = fmt.mtp_layer
            aliases = {alias.prefix: alias.to.replace("{i}", str(n))} if alias else None
            return Mapping(unused, resolver.value, range(n, n + 1), plan, str(self.path), renames, aliases)
        mtp_layers = range(n, n + int(resolver.value(spec_mtp.layers))) if spec_mtp else range(0)
        return Mapping(fmt, resolver.value, mtp_layers, plan, str(self.path))

    @cached_property
    def packing(self) -> Packing | None:
        """Which parameters are stored packed (from the tensor headers); None when unquantized.
        The MTP layers' tensors are left out (set aside by `mapping`)."""
        return self._packing(self.mapping)

    @cached_property
    def mtp_packing(self) -> Packing | None:
        """The same with the NextN layer built (`mtp_mapping`): its packed weights too."""
        return self._packing(self.mtp_mapping)

    def _packing(self, mapping: Mapping) -> Packing | None:
        if self.quant is None:
            return None
        files = safetensors_io.shard_files(self.path)
        header = {
            t.name: (safetensors_io.DTYPES[t.dtype], t.shape)
            for f in files
            for t in safetensors_io.read_header(f)
        }
        return find_packing(
            self.quant, {n: h for n, h in header.items() if not mapping.is_mtp(n)}, mapping.param_of
        )

    def tensors(self, want: safetensors_io.Want | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor; `want` (safetensors): what of each to read (GGUF reads every one whole)."""
        if self.format == "gguf":
            return gguf_io.iter_tensors(self.path)
        return safetensors_io.iter_tensors(safetensors_io.shard_files(self.path), want)

    def count(self) -> int:
        if self.format == "gguf":
            return gguf_io.count_tensors(self.path)
        return safetensors_io.count_tensors(safetensors_io.shard_files(self.path))


def open_checkpoint(path: str | Path, family: str | None = None) -> Checkpoint:
    p = Path(path)
    if p.is_dir() and not (p / "config.json").exists():
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) != 1:
            raise CheckpointError(f"{p}: no config.json, and {len(ggufs)} .gguf files (need exactly one)")
        p = ggufs[0]
    if p.suffix == ".gguf":
        arch = gguf_io.metadata(p).get("general.architecture")
        fam = FAMILIES.get(family) if family else family_for_gguf(str(arch), str(p))
        fmt = next((w for w in fam.spec.spec.weights if w.format == "gguf"), None)
        if fmt is None:
            raise CheckpointError(f"{p}: family {fam.name} has no gguf weight rules")
        hf, config_tensors = gguf_io.hf_config(p, fmt.config, fmt.rope_parameters)
        return Checkpoint(p, "gguf", hf, fam, config_tensors=config_tensors)
    if not (p / "config.json").exists():
        raise CheckpointError(f"{p}: not a checkpoint folder (no config.json) nor a .gguf file")
    hf = json.loads((p / "config.json").read_text())
    gen = p / "generation_config.json"  # chat models list their end-of-turn ids here
    if gen.exists() and (eos := json.loads(gen.read_text()).get("eos_token_id")) is not None:
        hf["eos_token_id"] = eos
    fam = FAMILIES.get(family) if family else family_for(hf, str(p / "config.json"))
    return Checkpoint(p, "safetensors", hf, fam, read_quant_config(p, hf))


def _load_head(writer: StrictWriter, head: Checkpoint) -> None:
    """The NextN layer's tensors from a head's own folder; one that maps outside the layer (`mtp.*`)
    is refused by name, so a head cannot overwrite the model it drafts for."""
    mapping = head.mtp_mapping
    for name, tensor in head.tensors():
        if mapping.is_mtp(name):  # copies of the shared embedding or head
            continue
        target = mapping.target(name)
        if target is None:
            continue
        params = [t.param for t in target.parts] if isinstance(target, Split) else [target.param]
        if outside := [q for q in params if not q.startswith("mtp.")]:
            raise WeightError(
                f"{head.path}: tensor {name} writes {outside[0]}, not the NextN layer: an MTP head's "
                f"folder holds that layer's tensors only (model.layers.{len(mapping.layers) - 1}.*)"
            )
        if isinstance(target, Split):
            writer.write_split(name, target, tensor)
        else:
            writer.write(name, target, tensor)


def open_mtp_head(path: str | Path, base: Checkpoint) -> Checkpoint:
    """A NextN head in its own folder, for `base`, whose checkpoint carries none: config.json
    with the MTP fields (num_nextn_predict_layers: 1, ...) and safetensors holding the tensors a
    checkpoint with the layer would (`model.layers.{L}.*` in Llama's naming). The head reads as
    a checkpoint of base's family with base's config and the head's fields on top (a nested
    config, e.g. text_config, field by field); a field both hold must agree, the MTP layer count
    aside (a head made for another model is refused, by field)."""
    p = Path(path)
    if not (p / "config.json").exists():
        raise CheckpointError(f"{p}: an MTP head's folder needs a config.json (and its safetensors)")
    head = json.loads((p / "config.json").read_text())
    _check_head(head, base.hf, _mtp_fields(base.family), p, base.path)
    return Checkpoint(p, "safetensors", merge(base.hf, head), base.family)


def _check_head(head: dict, hf: dict, own: set[str], path: Path, base: Path, prefix: str = "") -> None:
    """Every field of a head's config (nested ones, e.g. text_config.*, by their dotted names)
    agrees with the base's, or is one of the MTP layer count fields `own`."""
    for key, value in head.items():
        name = prefix + key
        if name in own:  # the layer count: the base's may say 0 (a checkpoint without the layer)
            continue
        if key in hf and isinstance(value, dict) and isinstance(hf[key], dict):
            _check_head(value, hf[key], own, path, base, f"{name}.")
        elif key in hf and not _same(value, hf[key]):
            raise CheckpointError(
                f"{path}: the MTP head was made for another model: {name} is {value!r} in its config.json, "
                f"{hf[key]!r} in {base}'s"
            )
        elif key not in hf:  # it would change the model it drafts for
            raise CheckpointError(
                f"{path}: config.json sets {name}, which {base}'s config does not; a head's config "
                f"adds only the MTP layer count ({', '.join(sorted(own)) or 'none in this spec'})"
            )


def _mtp_fields(family: Family) -> set[str]:
    """The config fields the spec's `mtp.layers` reads (a `$symbol`'s fields)."""
    spec = family.spec.spec
    layers = spec.mtp.layers if spec.mtp is not None else None
    if not (isinstance(layers, str) and layers.startswith("$")):
        return set()
    sym = spec.symbols.get(layers[1:])
    field = sym if isinstance(sym, str) else getattr(sym, "field", None)
    return {field} if isinstance(field, str) else set(field or ())


def _same(a: object, b: object) -> bool:
    """Config values equal (floats to float32's rounding: a GGUF stores them in 32 bits)."""
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, int | float) and isinstance(b, int | float) and math.isclose(a, b, rel_tol=1e-6)
    return a == b


LOAD_FORMATS = ("auto", "dummy")  # dummy: vLLM's --load-format dummy (random weights, nothing read)


def refuse_dummy(ckpt: Checkpoint) -> None:
    if ckpt.quant is not None:
        raise CheckpointError(f"{ckpt.path}: --load-format dummy makes float weights; this one is quantized")


def fill_dummy(model: nn.Module, ckpt: Checkpoint, seed: int = 0) -> None:
    """Random weights for timing and serving tests without the checkpoint's files (vLLM's
    `--load-format dummy`): every parameter N(0, 0.02^2), drawn on its device from a fixed seed.
    Float checkpoints only (`refuse_dummy`): a quantized one's packing comes from its tensor headers."""
    refuse_dummy(ckpt)
    gens: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for p in model.parameters():
            g = gens.setdefault(p.device, torch.Generator(device=p.device).manual_seed(seed))
            p.normal_(0.0, 0.02, generator=g)


def load_weights(
    model: nn.Module,
    ckpt: Checkpoint,
    progress: bool = True,
    tensors: Iterator[tuple[str, torch.Tensor]] | None = None,
    count: int | None = None,
    packing: Packing | None = None,
    head: Checkpoint | None = None,
) -> int:
    """Stream every checkpoint tensor into the model through the spec's rules; strict. Returns
    how many MTP-layer tensors were set aside (the spec's `mtp` patterns).

    `tensors` (with `count`) replaces reading ckpt's files: weights already in memory, in the
    checkpoint's naming (the decode benchmark hands over the reference model's this way), with
    `packing` the packing of those tensors when they are quantized. `head` (open_mtp_head): the
    model's NextN layer comes from there, not from ckpt (whose MTP tensors, if any, stay aside)."""
    own_mtp = getattr(model, "mtp", None) is not None and head is None  # the NextN layer from ckpt
    mapping = ckpt.mtp_mapping if own_mtp else ckpt.mapping
    writer = StrictWriter(model)
    packing = packing if packing is not None else ckpt.mtp_packing if own_mtp else ckpt.packing
    packed = packing.tensors if packing else {}
    aside = 0
    total = count if tensors is not None else ckpt.count()
    bar = tqdm(total=total, desc="loading weights", unit="tensor", disable=not progress, leave=False)
    sliced: set[str] = set()

    def want(name: str, _shape) -> object:
        """Tensor parallel: this rank's slice of a tensor, nothing of another rank's expert."""
        if name in ckpt.config_tensors or mapping.is_mtp(name) or name in packed:
            return True
        target = mapping.target(name)
        part = None if target is None else writer.wants(name, target)
        if part is None:
            bar.update(1)  # not read at all
        elif part is not True:
            sliced.add(name)
        return part

    sharded = tensors is None and bool(writer.shards)
    for name, tensor in tensors if tensors is not None else ckpt.tensors(want if sharded else None):
        if name in ckpt.config_tensors:  # read into the config when the checkpoint was opened
            bar.update(1)
            continue
        if mapping.is_mtp(name):
            aside += 1
            bar.update(1)
            continue
        if name in packed:
            weight, comp = packed[name]
            target = mapping.target(weight)
            if target is not None:
                writer.write_packed(name, target, comp, tensor, packing.config.convention)
        elif isinstance(target := mapping.target(name), Split):
            writer.write_split(name, target, tensor)
        elif target is not None:
            writer.write(name, target, tensor, sliced=name in sliced)
        del tensor  # dropped before the next tensor is read (bounds peak memory)
        bar.update(1)
    bar.close()
    if head is not None:
        _load_head(writer, head)
    writer.finish()
    if aside:
        log.info("%d MTP tensor(s) set aside: the MTP runtime (speculative decoding) is not built yet", aside)
    return aside
