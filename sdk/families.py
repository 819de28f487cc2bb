"""The family registry: one entry per `models/<family>/spec.yaml`, plus the specs outside
models/ (`sdk/out_of_tree.py`: `--spec PATH`, DAYZERO_SPECS, the `dayzero.families` entry
points), and model construction.

`build` turns (family, HF config) into the generated model on a device, with its kernels
selected: an op this device cannot run fails here, before any weight is read.
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from dayzero.kernels.collective import TpGroup
from dayzero.kernels.registry import OPS, Registry
from dayzero.kernels.selection import OpTable
from dayzero.sdk.blocks import BLOCKS
from dayzero.sdk.blocks.ngram import ngram_needs
from dayzero.sdk.config.model import ONE_RANK, ModelConfig, Parallel
from dayzero.sdk.errors import SpecError
from dayzero.sdk.out_of_tree import (
    OutOfTreeError,
    Source,
    check_generated,
    entry_point_sources,
    env_sources,
    import_generated,
    remember,
    spec_file,
)
from dayzero.sdk.quant.materialize import materialize
from dayzero.sdk.quant.packing import PackedParam
from dayzero.sdk.spec.assemble import resolve
from dayzero.sdk.spec.read import LoadedSpec, load_spec
from dayzero.sdk.spec.schema import Spec

MODELS_DIR = Path(importlib.import_module("dayzero.models").__path__[0])


@dataclass
class Family:
    """A spec and its generated package: `models/<f>/` is family `<f>`; a variant architecture
    of a family lives in `models/<f>/<v>/` as family `<f>_<v>`. A spec outside models/ names
    its family itself (`family:`), its generated files next to it; `origin` says where it was
    declared."""

    name: str
    spec_path: Path
    origin: str = "models/"

    @property
    def in_tree(self) -> bool:
        return self.spec_path.parent.is_relative_to(MODELS_DIR)

    @cached_property
    def spec(self) -> LoadedSpec:
        loaded = load_spec(self.spec_path)
        if loaded.spec.family != self.name:
            raise SpecError(str(self.spec_path), "family", f"must be {self.name!r} (its folder)")
        return loaded

    @property
    def folder(self) -> str:
        """The package folder relative to models/ (e.g. `glm53/flash`); a spec outside models/
        (a test's scratch family) is its own folder's name."""
        parent = self.spec_path.parent
        return parent.relative_to(MODELS_DIR).as_posix() if parent.is_relative_to(MODELS_DIR) else parent.name

    def module(self, part: str = "model"):
        if self.in_tree:
            return importlib.import_module(f"dayzero.models.{self.folder.replace('/', '.')}.{part}")
        folder = self.spec_path.parent
        check_generated(folder, self.spec.hash, f"dayzero codegen --spec {self.spec_path}")
        return import_generated(self.name, folder, part)

    def config(
        self, hf: dict, source: str = "config.json", par: Parallel = ONE_RANK, mtp: bool = False
    ) -> ModelConfig:
        """mtp: with the NextN layer (MtpCfg), for speculative decoding that drafts with it."""
        return resolve(self.spec, hf, self.module("cache").CACHE_GROUPS, source, par, mtp)


def _discover() -> Registry[Family]:
    reg: Registry[Family] = Registry("model family")
    for spec in sorted([*MODELS_DIR.glob("*/spec.yaml"), *MODELS_DIR.glob("*/*/spec.yaml")]):
        name = spec.parent.relative_to(MODELS_DIR).as_posix().replace("/", "_")
        reg.add(name, Family(name, spec))
    for source in [*entry_point_sources(), *env_sources()]:
        _admit(reg, source)
    return reg


def _admit(reg: Registry[Family], source: Source) -> Family:
    """The family of a spec outside models/, added to reg: its spec is read and validated now;
    a family name already taken, or an architecture or model_type another family serves (the
    detection would be ambiguous), is refused naming the other family and where it came from.
    The same spec file a second time is the family already there."""
    try:
        loaded = load_spec(source.spec_path)
    except SpecError as e:
        raise OutOfTreeError(f"{source.origin}: {e}") from None
    name = loaded.spec.family
    if name in reg and reg.get(name).spec_path.resolve() == source.spec_path:
        return reg.get(name)
    fam = Family(name, source.spec_path, source.origin)
    fam.spec = loaded  # the cached_property's value: validated above
    for other_name, other in reg.items():
        if clash := _shared(fam, other):
            field, what = clash
            raise SpecError(
                str(source.spec_path),
                field,
                f"({source.origin}) {what} is already family {other_name}'s "
                f"({other.origin}: {other.spec_path}); give this spec its own",
            )
    reg.add(name, fam)
    return fam


def gguf_architectures(spec: Spec) -> list[str]:
    """The general.architecture values of the GGUF files a spec's gguf section reads by name."""
    return [a for w in spec.weights if w.format == "gguf" for a in w.general_architecture]


def _shared(fam: Family, other: Family) -> tuple[str, str] | None:
    """(the spec field, what) fam's spec claims that other's already does: the name, an
    architecture, a model_type (a spec that does not load serves nothing: `dayzero specs`
    reports it)."""
    if fam.name == other.name:
        return "family", f"the family name {fam.name!r}"
    try:
        theirs = other.spec.spec
    except ValueError:
        return None
    mine = fam.spec.spec
    for field, what, ours, their in (
        ("architectures", "architecture", mine.architectures, theirs.architectures),
        ("model_types", "model_type", mine.model_types, theirs.model_types),
        (
            "weights.general_architecture",
            "GGUF architecture",
            gguf_architectures(mine),
            gguf_architectures(theirs),
        ),
    ):
        if shared := [v for v in ours if v in their]:
            return field, f"{what} {shared[0]!r}"
    return None


FAMILIES = _discover()


def register_spec(path: str | Path, origin: str = "--spec") -> Family:
    """The family of the spec at path (a spec.yaml or its folder), registered for this process
    and, through DAYZERO_SPECS, the processes it starts; see `_admit` for what is refused."""
    fam = _admit(FAMILIES, Source(spec_file(path), origin))
    if not fam.in_tree:  # models/ is discovered anyway
        remember(fam.spec_path)
    return fam


def spec_family(spec: str | Path, family: str | None = None) -> str:
    """The family a verb's `--spec` names (registered), checked against its `--family`."""
    fam = register_spec(spec)
    if family not in (None, fam.name):
        raise ValueError(f"--family {family} and --spec {spec} (family {fam.name}) disagree: give one")
    return fam.name


def family_for(hf: dict, source: str = "config.json") -> Family:
    """The family serving this HF config: the one whose spec lists both its `architectures` and
    its `model_type` (one of them missing: the other decides). A config where the two point
    different ways is refused, naming both; a checkpoint whose `architectures` is wrong is served
    by naming its family (`--family`), which skips this detection."""
    archs, mtype = hf.get("architectures") or [], hf.get("model_type")
    by_arch = next((f for _, f in FAMILIES.items() if set(archs) & set(f.spec.spec.architectures)), None)
    by_type = next((f for _, f in FAMILIES.items() if mtype in f.spec.spec.model_types), None)
    if by_arch is None and by_type is None:
        known = ", ".join(f"{n} ({'/'.join(f.spec.spec.architectures)})" for n, f in FAMILIES.items())
        raise SpecError(source, "architectures", f"no family serves {archs or mtype!r}; known: {known}")
    if not archs or mtype is None or by_arch is by_type:
        return by_arch or by_type
    arch = "/".join(archs)

    def whose(f: Family | None) -> str:
        return f"family {f.name}'s" if f else "no family's"

    guess = by_type or by_arch
    raise SpecError(
        source,
        "architectures",
        f"{arch} ({whose(by_arch)}) and model_type {mtype!r} ({whose(by_type)}) disagree; if the "
        f"checkpoint is a {guess.name} model whose config is wrong, name the family: --family {guess.name}",
    )


def family_for_gguf(arch: str, source: str) -> Family:
    """The family serving a GGUF file whose general.architecture is `arch`: the one whose gguf
    section names it (`general_architecture`: llama.cpp's `gemma3` is Gemma 3's text decoder),
    else the one with that model_type (`llama`)."""
    named = [f for _, f in FAMILIES.items() if arch in gguf_architectures(f.spec.spec)]
    return named[0] if named else family_for({"model_type": arch}, source)


def kernel_needs(cfg: ModelConfig, ops: OpTable, packed: frozenset[str] = frozenset()) -> OpTable:
    """The ops the model runs; `packed`: the formats (and act_quant) of its packed weights."""
    ops.need("embedding")
    ops.need("rms_norm", {"weight_in_fp32"} if cfg.final_norm.weight_in_fp32 else ())
    ops.need("linear")
    ops.need("sample", {"greedy", "temperature", "top_k", "top_p", "min_p", "seed", "penalties", "grammar"})
    if cfg.head.softcap is not None:
        ops.need("softcap")
    for layer in cfg.layers:
        for res in (layer.attn_res, layer.mlp_res):
            if res.kind == "postnorm":  # post_norm(f(x)), then the add: no norm of the next input
                ops.need("rms_norm", {"weight_in_fp32"} if res.norm.weight_in_fp32 else ())
            elif res.kind == "hyper" and res.hyper.mixer == "sinkhorn":  # mHC's weights, the streams' mix
                ops.need("hc_pre")
                ops.need("hc_post")
            elif res.kind == "hyper":  # the low-rank mixer's spread + norms, its block input and weights
                ops.need("hc_lowrank_norm")
                ops.need("hc_lowrank_mix")
            elif res.kind != "hyper":  # a residual's add and the next block's norm: one fused op
                n = res.norm
                post = {"post_norm"} if res.kind == "sandwich" else set()
                feats = (
                    post
                    | ({"scaled"} if res.add_index or res.branch_scale != 1.0 else set())
                    | ({"weight_in_fp32"} if n.weight_in_fp32 else set())
                )
                ops.need("add_rms_norm", feats)
        for kind, sub in ((layer.attn_kind, layer.attn), (layer.mlp_kind, layer.mlp)):
            for op, features, head_dim in BLOCKS.get(kind).needs(sub):
                ops.need(op, features, head_dim)
        for op, features, head_dim in ngram_needs(layer.ngram) if layer.ngram is not None else ():
            ops.need(op, features, head_dim)
    if packed:  # an op with a packed twin needs it too, with the formats on top of its features
        for op, need in ops.needs().items():
            if twin := OPS.get(op).packed:
                ops.need(twin, need.features | packed)
    return ops


@contextlib.contextmanager
def born_as(device: torch.device, dtype: torch.dtype):
    """Modules made inside get their parameters on `device` in `dtype` directly."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


@contextlib.contextmanager
def params_on_meta():
    """Parameters registered inside move to the meta device as they are made (one real
    allocation at a time); `materialize` makes them real once their packing is known."""

    def hook(_module, _name, p):
        return None if p is None else torch.nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    handle = torch.nn.modules.module.register_module_parameter_registration_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def build(
    fam: Family,
    cfg: ModelConfig,
    hf: dict,
    device: torch.device,
    dtype: torch.dtype,
    packed: dict[str, PackedParam] | None = None,
    act_quant: bool = False,
    tp: TpGroup | None = None,
):
    """The generated model for cfg, parameters uninitialised (the loader writes them); `packed`
    (a checkpoint's Packing.params) names the parameters held packed; `tp`: the group a
    sharded cfg (cfg.parallel) runs its collectives over."""
    packed = packed or {}
    tp = tp or TpGroup()
    if (tp.size, tp.rank) != (cfg.parallel.size, cfg.parallel.rank):
        raise ValueError(
            f"the config is rank {cfg.parallel.rank} of {cfg.parallel.size}, "
            f"the group rank {tp.rank} of {tp.size}"
        )
    features = frozenset(p.format for p in packed.values()) | ({"act_quant"} if act_quant else set())
    ops = kernel_needs(cfg, OpTable(device, dtype, tp), features).resolve()
    with born_as(device, dtype), params_on_meta():  # no fp32 copy of a big model
        model = fam.module("model").Model(cfg, ops)
    for m in model.modules():
        for name in getattr(m, "fp32_params", ()):
            p = getattr(m, name, None)
            if p is not None:
                p.data = p.data.float()
    materialize(model, device, packed, act_quant)
    return model.eval(), ops
