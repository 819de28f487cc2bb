"""Weight mapping as data: a spec's rules compiled to matchers, and the strict writer.

Every checkpoint tensor must match one rule (or an ignore pattern); every parameter element
must be written exactly once. A rule target `name[sel][sel]` narrows the parameter: `[{e}]`
picks an index along the leading dim (expert stacking), `[part]` a named slice of a fused
parameter (its sizes come from the block's `parts`). A rule's transforms (sdk/transforms.py)
run in order on the tensor; a splitting one last cuts it into one piece per target (`Split`).
A block-scoped rule applies to the layers whose attention or mlp is one of its blocks.
A rule whose target is a buffer the model derives from its config (the n-gram hash tables)
checks that the checkpoint's copy equals it, and writes nothing.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from dayzero.kernels.packed import PackedWeight
from dayzero.sdk.config.model import Slice
from dayzero.sdk.errors import SpecError, WeightError
from dayzero.sdk.quant.layout import expected_shape, slice_component, take_rows, to_rows
from dayzero.sdk.spec.schema import WeightFormat, WeightRule
from dayzero.sdk.transforms import TRANSFORMS, bind


@dataclass(frozen=True)
class Target:
    param: str
    selectors: tuple[int | str, ...]
    transform: Callable[[torch.Tensor], torch.Tensor] | None


@dataclass(frozen=True)
class Split:
    """One checkpoint tensor cut by its rule's transforms into pieces, one target each."""

    parts: tuple[Target, ...]  # each without a transform of its own
    transform: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]

    @property
    def param(self) -> str:
        return self.parts[0].param


@dataclass(frozen=True)
class _Rule:
    pattern: re.Pattern
    src: str
    to: tuple[str, ...]
    transform: Callable | None
    splits: bool
    skip: bool
    scope: frozenset[str]  # block names; empty: every layer


_PLACEHOLDER = re.compile(r"\\\{([ie])\\\}")


def _chain(rule: WeightRule, value: Callable, where: str, source: str) -> Callable | None:
    """The rule's transforms, resolved and checked, as one function; a failing step raises
    ValueError naming its kind."""
    steps = []
    for tf in rule.transforms:
        try:
            args = {k: [value(x) for x in v] if isinstance(v, list) else value(v) for k, v in tf.args.items()}
            steps.append((tf.kind, bind(tf.kind, args)))
        except (ArithmeticError, TypeError, ValueError) as e:  # pydantic's ValidationError too
            if isinstance(e, SpecError):
                raise
            msg = str(e).splitlines()
            raise SpecError(source, where, f"{' '.join(msg[:3])} (rule from {rule.src})") from None
    if not steps:
        return None

    def run(w: torch.Tensor):
        for kind, fn in steps:
            try:
                w = fn(w)
            except (RuntimeError, ValueError, IndexError) as e:
                raise ValueError(f"transform {kind}: {e}") from None
        return w

    return run


class Mapping:
    """A format's rules for one config; `layers`: each layer's block names (attention, mlp),
    which block-scoped rules match against."""

    def __init__(
        self,
        fmt: WeightFormat,
        value: Callable,
        mtp_layers: range = range(0),
        layers: Sequence[tuple[str, ...]] = (),
        source: str = "config.json",
        renames: dict[str, str] | None = None,
        aliases: dict[str, str] | None = None,
    ) -> None:
        self.rules: list[_Rule] = []
        self.renames = tuple((renames or {}).items())  # target prefixes: the NextN layer's, `mtp.layer.`
        self.aliases = tuple((aliases or {}).items())  # source prefixes read as others (mtp.layers.0.)
        self.layers = [tuple(b) for b in layers]
        for ri, rule in enumerate(fmt.rules):
            skip = bool(value(rule.unless)) if rule.unless else False
            pattern = re.compile("^" + _PLACEHOLDER.sub(r"(?P<\1>\\d+)", re.escape(rule.src)) + "$")
            where = f"weights.{fmt.format}.rules.{ri}.transform"
            tf = _chain(rule, value, where, source)
            splits = bool(rule.transforms) and TRANSFORMS.get(rule.transforms[-1].kind).splits
            self.rules.append(
                _Rule(pattern, rule.src, tuple(rule.targets), tf, splits, skip, frozenset(rule.blocks))
            )
        self.ignore = list(fmt.ignore)
        self.mtp = [p.replace("{mtp}", str(i)) for p in fmt.mtp for i in mtp_layers]

    def is_mtp(self, name: str) -> bool:
        """A tensor of an MTP layer: set aside for the MTP runtime (checked before the rules)."""
        return any(fnmatch.fnmatchcase(name, p) for p in self.mtp)

    def param_of(self, name: str) -> str | None:
        """The model parameter a checkpoint tensor writes; None when deliberately ignored."""
        t = self.target(name)
        return None if t is None else t.param

    def target(self, name: str) -> Target | Split | None:
        """Where a checkpoint tensor goes; None when deliberately ignored."""
        for old, new in self.aliases:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        scoped_out: list[_Rule] = []  # rules whose pattern matched, for another layer kind
        layer = None
        for rule in self.rules:
            m = rule.pattern.match(name)
            if m is None:
                continue
            groups = m.groupdict()
            if rule.scope:
                layer = int(groups["i"])
                if rule.scope.isdisjoint(self._blocks(layer)):
                    scoped_out.append(rule)
                    continue
            if rule.skip:
                return None
            targets = tuple(self._fill(to, groups, None if rule.splits else rule.transform) for to in rule.to)
            targets = tuple(self._renamed(t) for t in targets)
            return Split(targets, rule.transform) if rule.splits else targets[0]
        if any(fnmatch.fnmatchcase(name, p) for p in self.ignore):
            return None
        if scoped_out:
            blocks = ", ".join(sorted({b for r in scoped_out for b in r.scope}))
            kinds = " + ".join(self._blocks(layer)) or "not a layer of this config"
            raise WeightError(
                f"checkpoint tensor {name} matches weight rules only for layers of blocks {blocks}; "
                f"layer {layer} is {kinds}, and no rule maps it there"
            )
        raise WeightError(f"checkpoint tensor {name} matches no weight rule and is not ignored")

    def _blocks(self, layer: int | None) -> tuple[str, ...]:
        """Layer `layer`'s (attention, mlp) block names; none past the last layer."""
        return self.layers[layer] if layer is not None and 0 <= layer < len(self.layers) else ()

    def _renamed(self, t: Target) -> Target:
        for old, new in self.renames:
            if t.param.startswith(old):
                return Target(new + t.param[len(old) :], t.selectors, t.transform)
        return t

    @staticmethod
    def _fill(to: str, groups: dict, tf: Callable | None) -> Target:
        filled = to.replace("{i}", groups.get("i", "{i}")).replace("{e}", groups.get("e", "{e}"))
        param, *sels = re.findall(r"[^\[\]]+", filled)
        return Target(param, tuple(int(s) if s.isdigit() else s for s in sels), tf)


# elements checked at a time: the check's temporaries stay small (on the CPU, freed temporaries
# stay resident in the allocator, so a whole-tensor check would cost several times its size)
FINITE_CHUNK = {"cpu": 1 << 18, "cuda": 1 << 26}


def _finite(t: torch.Tensor) -> bool:
    flat = t.reshape(-1)
    return all(bool(torch.isfinite(c).all()) for c in flat.split(FINITE_CHUNK.get(t.device.type, 1 << 20)))


class StrictWriter:
    """Writes tensors into a model's parameters, tracking coverage row by row. A packed weight
    (kernels/packed.py) is written component by component, each tracked on its own."""

    def __init__(self, model: nn.Module) -> None:
        self.params = dict(model.named_parameters())
        self.buffers = dict(model.named_buffers())
        self.packed = {n: m for n, m in model.named_modules() if isinstance(m, PackedWeight)}
        self.parts: dict[str, dict[str, tuple[int, int]]] = {}
        self.shards: dict[str, dict[str, Slice]] = {}  # tensor parallel: what this rank keeps
        for prefix, mod in model.named_modules():
            if hasattr(mod, "parts") and hasattr(mod, "cfg"):
                for pname, sizes in mod.parts(mod.cfg).items():
                    offs, o = {}, 0
                    for part, n in sizes.items():
                        offs[part], o = (o, n), o + n
                    self.parts[f"{prefix}.{pname}" if prefix else pname] = offs
            if hasattr(mod, "shards") and hasattr(mod, "cfg"):
                for pname, slices in mod.shards(mod.cfg).items():
                    self.shards[f"{prefix}.{pname}" if prefix else pname] = slices
        self.covered = {
            n: torch.zeros(p.shape[:-1] if p.dim() > 1 else p.shape, dtype=torch.bool)
            for n, p in self.params.items()
        }
        for n, pw in self.packed.items():
            for comp, _ in pw.named_buffers():
                self.covered[f"{n}:{comp}"] = torch.zeros(pw.shape[:-1], dtype=torch.bool)

    def _narrow(self, tensor_name: str, t: Target, dst: torch.Tensor, cov: torch.Tensor):
        """The slice of dst (and its coverage) that t's selectors pick: [e] along the leading
        dim, then [part] along the rows. None: an expert another rank holds (expert parallel)."""
        for sel in t.selectors:
            if isinstance(sel, int):
                if (sel := self._local_expert(t, sel)) is None:
                    return None
                if sel >= dst.shape[0]:
                    raise WeightError(
                        f"checkpoint tensor {tensor_name}: index {sel} out of {dst.shape[0]} in {t.param}"
                    )
                dst, cov = dst[sel], cov[sel]
            else:
                offs = self.parts.get(t.param, {})
                if sel not in offs:
                    raise WeightError(f"{t.param} has no part {sel!r}; parts: {', '.join(offs) or '(none)'}")
                off, n = offs[sel]
                dst, cov = dst.narrow(0, off, n), cov.narrow(0, off, n)
        return dst, cov

    def _local_expert(self, t: Target, e: int) -> int | None:
        """Expert index e as this rank holds it (expert parallel: shifted by its first expert;
        None: another rank's); e itself when the parameter's experts are not placed."""
        placed = self.shards.get(t.param, {}).get("[e]")
        if placed is None:
            return e
        return e - placed.start if placed.start <= e < placed.start + placed.length else None

    def _slice_of(self, tensor_name: str, t: Target) -> Slice | None:
        """The slice of a checkpoint tensor this rank keeps (tensor parallel); None: all of it."""
        slices = self.shards.get(t.param)
        if not slices:
            return None
        part = next((s for s in reversed(t.selectors) if isinstance(s, str)), "")
        sl = slices.get(part)
        if sl is None and not any(isinstance(s, int) for s in t.selectors):
            sl = slices.get("[e]")  # all experts in one tensor: this rank's run of them
        if sl is None and (parts := sorted(set(slices) - {"[e]"})):
            raise WeightError(
                f"checkpoint tensor {tensor_name} writes {t.param} whole, which tensor parallelism "
                f"splits by part ({', '.join(parts)}); map each part by its own rule"
            )
        return sl

    def wants(self, tensor_name: str, t: Target | Split) -> Slice | bool | None:
        """What of a checkpoint tensor this rank reads: None nothing (another rank's expert),
        True all of it (also when a transform needs the whole tensor), or its Slice."""
        if isinstance(t, Split):
            return True
        e = next((s for s in t.selectors if isinstance(s, int)), None)
        if e is not None and self._local_expert(t, e) is None:
            return None
        sl = self._slice_of(tensor_name, t)
        return True if sl is None or t.transform is not None else sl

    def _shard(self, tensor_name: str, t: Target, value: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a whole checkpoint tensor (as it is on one rank)."""
        sl = self._slice_of(tensor_name, t)
        if sl is None:
            return value
        if value.dim() < -sl.dim or value.shape[sl.dim] < sl.start + sl.length:
            raise WeightError(
                f"checkpoint tensor {tensor_name}: shape {list(value.shape)} has no indices "
                f"{sl.start}..{sl.start + sl.length - 1} along dim {sl.dim} for this rank's {t.param}"
            )
        return value.narrow(sl.dim, sl.start, sl.length)

    def _store(self, tensor_name: str, param: str, dst, cov, value: torch.Tensor) -> None:
        if cov.any():
            raise WeightError(f"checkpoint tensor {tensor_name} writes {param}, which was already written")
        dst.copy_(value)
        cov.fill_(True)

    def write(self, tensor_name: str, t: Target, value: torch.Tensor, sliced: bool = False) -> None:
        """Write one checkpoint tensor (sliced: already this rank's slice, read as `wants` said)."""
        if t.param in self.packed:
            dt = str(value.dtype).removeprefix("torch.")
            raise WeightError(
                f"checkpoint tensor {tensor_name} is stored unquantized ({dt}) "
                f"but other parts of {t.param} are {self.packed[t.param].format.name}"
            )
        if t.param not in self.params and t.param in self.buffers and not t.selectors:
            return self._check_derived(tensor_name, t.param, value)
        if t.param not in self.params:
            raise WeightError(
                f"checkpoint tensor {tensor_name} maps to {t.param}, which this model does not have"
            )
        if not value.is_floating_point():
            raise WeightError(
                f"checkpoint tensor {tensor_name} has dtype {value.dtype}; expected a float type"
            )
        narrowed = self._narrow(tensor_name, t, self.params[t.param].data, self.covered[t.param])
        if narrowed is None:  # another rank's expert
            return
        dst, cov = narrowed
        if t.transform is not None:
            value = self._transformed(tensor_name, t.transform, value)
        if not sliced:
            value = self._shard(tensor_name, t, value)
        if tuple(value.shape) != tuple(dst.shape):
            raise WeightError(
                f"checkpoint tensor {tensor_name}: shape {list(value.shape)}, "
                f"expected {list(dst.shape)} for {t.param}"
            )
        if not _finite(value):
            raise WeightError(f"checkpoint tensor {tensor_name} holds NaN or inf")
        self._store(tensor_name, t.param, dst, cov, value)

    def _check_derived(self, tensor_name: str, name: str, value: torch.Tensor) -> None:
        """A checkpoint's copy of a buffer the model computes from its config must equal it."""
        want = self.buffers[name]
        if tuple(value.shape) != tuple(want.shape) or not torch.equal(
            value.to(want.device, want.dtype), want
        ):
            got, exp = value.flatten()[:6].tolist(), want.flatten()[:6].tolist()
            raise WeightError(
                f"checkpoint tensor {tensor_name} (shape {list(value.shape)}, starting {got}) differs "
                f"from {name} as derived from the config (shape {list(want.shape)}, starting {exp})"
            )

    @staticmethod
    def _transformed(tensor_name: str, tf: Callable, value: torch.Tensor):
        try:
            return tf(value)
        except ValueError as e:
            raise WeightError(f"checkpoint tensor {tensor_name} (shape {list(value.shape)}): {e}") from None

    def write_split(self, tensor_name: str, t: Split, value: torch.Tensor) -> None:
        """A tensor cut by its rule's transforms: each piece written to its own target."""
        pieces = self._transformed(tensor_name, t.transform, value)
        for part, piece in zip(t.parts, pieces, strict=True):
            self.write(tensor_name, part, piece)

    def write_packed(
        self, tensor_name: str, t: Target | Split, comp: str, value: torch.Tensor, convention: str
    ) -> None:
        """One component of a packed weight (sdk/quant/layout.py: names, shapes, per-row form).
        A rule that cuts the weight into parts by whole rows (split, split_heads) cuts each
        component by the same rows; any other transform is refused (packed weights are written
        as stored)."""
        if isinstance(t, Split):
            for part, rows in zip(t.parts, self._row_pieces(tensor_name, t), strict=True):
                piece = take_rows(convention, self.packed_format(part), comp, value, rows, tensor_name)
                self.write_packed(tensor_name, part, comp, piece, convention)
            return
        if t.transform is not None:
            raise WeightError(
                f"checkpoint tensor {tensor_name} is a packed component of a weight whose rule "
                f"transforms it; packed weights are written as stored"
            )
        pw = self.packed.get(t.param)
        if pw is None:
            raise WeightError(
                f"checkpoint tensor {tensor_name} is a packed component, but {t.param} is not packed"
            )
        fmt = pw.format.name
        narrowed = self._narrow(tensor_name, t, getattr(pw, comp), self.covered[f"{t.param}:{comp}"])
        if narrowed is None:
            return
        dst, cov = narrowed
        want = pw.format.component(comp).dtype
        if value.dtype != want and not (comp in ("global", "input") and value.is_floating_point()):
            raise WeightError(
                f"checkpoint tensor {tensor_name} has dtype {str(value.dtype).removeprefix('torch.')}; "
                f"the {fmt} {comp} is {str(want).removeprefix('torch.')}"
            )
        if (sl := self._slice_of(tensor_name, t)) is not None:  # this rank's part (tensor parallel)
            value = slice_component(convention, fmt, comp, value, sl, tensor_name)
        shapes = expected_shape(convention, fmt, comp, dst.shape[0], pw.shape[-1])
        if tuple(value.shape) not in shapes:
            raise WeightError(
                f"checkpoint tensor {tensor_name}: shape {list(value.shape)}, expected "
                f"{' or '.join(str(list(s)) for s in shapes)} for {t.param} ({fmt} {comp})"
            )
        if comp != "codes" or value.dtype != torch.uint8:
            bad = (value == 255).any() if value.dtype == torch.uint8 else not _finite(value.float())
            if bad:  # E8M0 255 is NaN
                raise WeightError(f"checkpoint tensor {tensor_name} holds NaN or inf")
        self._store(tensor_name, t.param, dst, cov, to_rows(fmt, comp, value, dst.shape[0]))

    def packed_format(self, t: Target) -> str:
        pw = self.packed.get(t.param)
        if pw is None:
            raise WeightError(f"a packed checkpoint tensor maps to {t.param}, which is not packed")
        return pw.format.name

    def _row_pieces(self, tensor_name: str, t: Split) -> list[list[int]]:
        """The float weight's rows each part of a split takes: the rule's transform applied to
        the row numbers; one that does more than move whole rows is refused."""
        sizes = [
            self.parts.get(p.param, {}).get(str(p.selectors[-1]) if p.selectors else "", (0, 0))[1]
            for p in t.parts
        ]
        n = sum(sizes)
        try:
            pieces = t.transform(torch.arange(n, dtype=torch.float64)[:, None])
        except ValueError as e:
            raise WeightError(f"checkpoint tensor {tensor_name}: {e}") from None
        rows = [p.flatten().tolist() if p.dim() == 2 and p.shape[1] == 1 else None for p in pieces]
        if any(r is None for r in rows) or sorted(x for r in rows for x in r) != list(range(n)):
            raise WeightError(
                f"checkpoint tensor {tensor_name} is packed, and its rule's transform does more than "
                f"cut whole rows into parts; packed weights are written as stored"
            )
        return [[int(x) for x in r] for r in rows]

    def _gaps(self, name: str) -> str:
        """Which parts / leading indices of a partly written parameter are missing."""
        cov = self.covered[name]
        param = name.split(":")[0]
        rows = cov.reshape(cov.shape[0], -1).all(-1) if cov.dim() > 1 else cov
        if param in self.parts and cov.dim() == 1:
            return ", ".join(p for p, (o, n) in self.parts[param].items() if not cov[o : o + n].all())
        idx = (~rows).nonzero().flatten().tolist()
        return f"index {', '.join(map(str, idx[:8]))}{' ...' if len(idx) > 8 else ''}"

    def finish(self) -> None:
        missing = [n for n, c in self.covered.items() if not c.all()]
        if missing:
            partial = [f"{n} [{self._gaps(n)}]" for n in missing if self.covered[n].any()]
            raise WeightError(
                f"{len(missing)} parameter(s) never written: {', '.join(missing[:10])}"
                + (f" (partly written: {'; '.join(partial[:5])})" if partial else "")
            )
