"""`dayzero parity`: dayzero and the reference class on the same checkpoint, the same prompts.

Checks (each a row of the report):
  prefill logits    all prompts prefilled in one batch; logits at every position vs the
                    reference's full-sequence forward (max abs diff)
  greedy            each prompt alone, 32 greedy tokens vs the reference's generate
                    (tokens identical, chosen-token logprobs close)
  mixed chunked     all prompts at once, chunk smaller than the prompts, prefills and decodes
                    sharing steps
  prefix cache      a second round over the same prompts in the same engine (cache hits)
  retraction host   KV memory too small for the batch: requests are retracted to host memory
  retraction recompute  the same with no host memory: retracted requests recompute
The retraction checks size the KV memory from the model (`retraction_budget`): the longest
request fits alone, never all of them together, so retraction happens at every model size; the
other checks' engines get room for every request twice plus a window and a step (`Ours.roomy`),
not the engine's default 256 MiB. `cache_checks=False` (the quantized tests: a packed format changes what the
weights read, never what the cache does) runs the first three checks only.
What passes (the bounds, the fp64 second opinion past fp32's, how low-precision tokens are
judged against fp32) is `criteria.py`. On failure, a layer-by-layer diff (`layer_diff.py`) names
the embedding or the first block that diverges. A column a check does not measure reads `-`;
`progress` gets a line as each check starts and ends.
"""

from __future__ import annotations

import copy
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from dayzero.sdk.api import default_device, parse_dtype
from dayzero.sdk.engine.engine import Engine, EngineConfig, SamplingParams
from dayzero.sdk.engine.memory import kv_capacity
from dayzero.sdk.families import Family, build
from dayzero.sdk.loader import Checkpoint, load_weights, open_checkpoint
from dayzero.sdk.parity.criteria import (
    TOP,
    Expected,
    Row,
    Sequence,
    Tolerance,
    agreement,
    compare,
    divergence_gap,
)
from dayzero.sdk.parity.dequant import write_dequantized
from dayzero.sdk.parity.layer_diff import layer_diff
from dayzero.sdk.scheduler import CacheGroup, Scheduler, make_config
from dayzero.sdk.spec.reference import reference_class


def _cell(x: float | None, width: int, fmt: str) -> str:
    return f"{'-' if x is None else format(x, fmt):>{width}}"


@dataclass
class Report:
    family: str
    device: str
    dtype: str
    rows: list[Row] = field(default_factory=list)
    layer_diff: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows)

    def table(self) -> str:
        lines = [
            f"parity {self.family} on {self.device}/{self.dtype}",
            f"{'check':<22} {'result':<6} {'max|dlogit|':>12} {'max|dlogprob|':>14} {'tokens':>7}  note",
        ]
        for r in self.rows:
            lines.append(
                f"{r.check:<22} {'ok' if r.ok else 'FAIL':<6} {_cell(r.logit_err, 12, '.3e')} "
                f"{_cell(r.logprob_err, 14, '.3e')} {_cell(r.agreement, 7, '.3f')}  {r.note}"
            )
        if self.layer_diff:
            lines += ["layer-by-layer diff (first prompt that failed):", *self.layer_diff]
        lines.append(f"parity {'PASSED' if self.ok else 'FAILED'}")
        return "\n".join(lines)


def make_prompts(vocab: int, seed: int, n: int = 8, window: int | None = None) -> list[list[int]]:
    """n prompts of distinct lengths (some past the sliding window), two sharing a prefix."""
    rng = np.random.default_rng(seed)
    longest = max(24, 3 * (window or 0))
    lengths = sorted(rng.choice(np.arange(3, longest + 1), size=n, replace=False).tolist())
    prompts = [rng.integers(0, vocab, size=k).tolist() for k in lengths]
    prompts[-1][: len(prompts[-2]) // 2] = prompts[-2][: len(prompts[-2]) // 2]
    return prompts


class Reference:
    """The reference class on `folder`: the checkpoint's, or for a quantized checkpoint the float
    one it dequantizes to (the reference sees the weights dayzero computes with)."""

    def __init__(self, ckpt: Checkpoint, folder: Path, device: torch.device, dtype: torch.dtype) -> None:
        cls = reference_class(ckpt.family.spec.spec.reference)
        # SDPA in low precision where the class has it (a plain-torch reference has one path)
        attn = "sdpa" if dtype != torch.float32 and cls._supports_sdpa else "eager"
        where: dict = {}
        if ckpt.format == "gguf":  # transformers' GGUF reader drops RoPE scaling; the config read here has it
            where = {"gguf_file": ckpt.path.name, "config": cls.config_class(**ckpt.hf)}
        model, info = cls.from_pretrained(
            folder, dtype=dtype, attn_implementation=attn, output_loading_info=True, **where
        )
        if missing := sorted(info.get("missing_keys") or ()):  # else their random values are compared
            unused = sorted(info.get("unexpected_keys") or ())
            raise RuntimeError(
                f"the reference {cls.__name__} did not find {len(missing)} of its weights in {folder}: "
                f"{', '.join(missing[:4])}; unused there: {', '.join(unused[:4]) or 'none'}"
            )
        self.model = model.to(device).eval()
        self.device = device

    def widened(self) -> Reference:
        """The same weights in fp64 (what fp32 is judged against past its bound)."""
        wide = copy.copy(self)
        wide.model = copy.deepcopy(self.model).double()
        if hasattr(wide.model, "set_experts_implementation"):  # grouped_mm takes no fp64
            wide.model.set_experts_implementation("eager")
        return wide

    @torch.inference_mode()
    def logits(self, prompt: list[int]) -> torch.Tensor:
        ids = torch.tensor([prompt], device=self.device)
        out = self.model(ids).logits[0]  # [L, V] fp32 (fp64 kept: `widened`)
        return out if out.dtype == torch.float64 else out.float()

    def greedy(self, prompt: list[int], n: int) -> Sequence:
        """n greedy tokens and their logprobs."""
        toks, logp = self._generate(prompt, n)
        return toks, _chosen(logp, toks)

    def greedy_top(self, prompt: list[int], n: int) -> tuple[Sequence, list[dict[int, float]]]:
        """`greedy`, and each position's TOP likeliest tokens -> logprob (the gap's candidates)."""
        toks, logp = self._generate(prompt, n)
        best = logp.topk(min(TOP, logp.shape[-1]), dim=-1)
        top = [
            dict(zip(i, v, strict=True))
            for i, v in zip(best.indices.tolist(), best.values.tolist(), strict=True)
        ]
        return (toks, _chosen(logp, toks)), top

    @torch.inference_mode()
    def _generate(self, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
        """n greedy tokens and the log-softmax of the logits each was chosen from [n, V] fp32."""
        ids = torch.tensor([prompt], device=self.device)
        out = self.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            eos_token_id=None,
            pad_token_id=0,
        )
        toks = out.sequences[0, len(prompt) :].tolist()
        return toks, torch.log_softmax(torch.stack([lg[0] for lg in out.logits]).float(), -1)


def _chosen(logp: torch.Tensor, toks: list[int]) -> list[float]:
    """logp [n, V] at each position's token."""
    return logp.gather(1, torch.tensor(toks, device=logp.device)[:, None])[:, 0].tolist()


class Ours:
    def __init__(self, ckpt: Checkpoint, device: torch.device, dtype: torch.dtype) -> None:
        self.cfg = ckpt.family.config(ckpt.hf, str(ckpt.path))
        packed = ckpt.packing.params if ckpt.packing else None
        self.model, self.ops = build(ckpt.family, self.cfg, ckpt.hf, device, dtype, packed)
        load_weights(self.model, ckpt, progress=False)
        self.budget: dict[str, int] = {}  # the engines' KV budgets, once `roomy` set them

    def roomy(self, lengths: list[int]) -> None:
        """KV budgets for the checks that must not retract: in blocks of 4 tokens (the smallest a
        check uses), every request at its final length twice (the prefix round keeps the first
        round's blocks) and a window and a step more (a sliding group's reservation), in every
        group, with the state slots of the default batch size; host memory the same. A step is
        at most the longest request (one prompt fits a step: prefills are not chunked)."""
        step, block = max(lengths), 4
        config = EngineConfig(block_size=block, max_tokens_per_step=step)
        cap = kv_capacity(self.cfg, self.ops.dtype.itemsize, config)
        groups = self.cfg.cache_groups
        window = max((g.window or 0 for g in groups), default=0)
        blocks = 2 * sum(-(-n // block) for n in lengths) + -(-(window + step) // block) + 2
        roomy = cap.budgets(config, len(groups) * blocks + 8, len(groups) * blocks + 8)
        self.budget = {
            "kv_cache_bytes": roomy.kv_cache_bytes,
            "host_cache_bytes": roomy.host_cache_bytes,
            "max_tokens_per_step": step,
        }

    def engine(self, **kw) -> Engine:
        return Engine(self.model, self.cfg, self.ops, EngineConfig(**(self.budget | kw)))

    @torch.inference_mode()
    def prefill_logits(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """All prompts prefilled in one step; logits at every position of every prompt."""
        # prefill only: no decode graphs (their capture would also run the layer diff's hooks)
        eng = self.engine(
            max_tokens_per_step=sum(map(len, prompts)), max_batch_size=len(prompts), decode_graphs="off"
        )
        return eng.prompt_logits(prompts)


RETRACTION = {"block_size": 8, "max_tokens_per_step": 64, "chunk_size": 16}  # the checks' engine


def retraction_budget(groups: list[CacheGroup], lengths: list[int], batch: int) -> int:
    """KV bytes for the retraction checks: the state slots, and pages for the longest request at
    its final length alone (plus one page a group), so the requests, admitted together, outgrow
    it. A request's blocks in a paged group: ceil(L / block); in a sliding group at most the
    window plus a chunk, ceil((window + chunk) / block) + 1, whatever L (a budget counted in
    whole lengths holds several long requests of a model that is mostly sliding windows)."""
    block, chunk = RETRACTION["block_size"], RETRACTION["chunk_size"]
    states = sum(g.state_bytes for g in groups)
    probe = states * 2 * batch + max(g.bytes_per_token for g in groups) * block * 64  # 64 pages
    fields = dict(RETRACTION, max_batch_size=batch, device_bytes=probe)
    if states:
        fields["snapshot_slots"] = batch  # as the engine has it: a snapshot per batch slot
    layout = Scheduler(make_config(groups, **fields)).layout
    longest, pages = max(lengths), 0
    for g, per_page in zip(groups, layout["blocks_per_page"], strict=True):
        if per_page:  # paged or sliding (a state group holds slots, not pages)
            blocks = -(-longest // block)
            if g.window:
                blocks = min(blocks, -(-(g.window + chunk) // block) + 1)
            pages += -(-blocks // per_page) + 1
    return layout["state_slot_bytes"] * layout["num_slots"] + layout["page_bytes"] * max(pages, 2)


@contextmanager
def _check(report: Report, name: str, say: Callable[[str], None], total: int) -> Iterator[None]:
    """One line as a check starts, one as it ends (its result: the row it appended)."""
    n = len(report.rows) + 1
    say(f"parity [{n}/{total}] {name} ...")
    t0 = time.perf_counter()
    yield
    ok = len(report.rows) >= n and report.rows[n - 1].ok
    say(f"parity [{n}/{total}] {name}: {'ok' if ok else 'FAIL'} in {time.perf_counter() - t0:.1f} s")


CHECKS = (
    "prefill logits",
    "greedy (one by one)",
    "mixed batch, chunked",
    "prefix-cache hits",
    "retraction (host)",
    "retraction (recompute)",
)


def require_generated(fam: Family) -> None:
    """The family's generated modules import: a codegen that failed (or never ran) is one error
    naming the family and the fix, not an import traceback."""
    try:
        for part in ("cache", "model"):
            fam.module(part)
    except ImportError as e:
        raise RuntimeError(
            f"family {fam.name} has no generated code that imports ({e}): run `dayzero codegen {fam.name}`"
        ) from None


def _worst(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """max |got - want| over the pairs, in the wider of the two dtypes."""
    return max((a.double() - b.double()).abs().max().item() for a, b in zip(got, want, strict=True))


def run_parity(
    checkpoint: str | Path,
    device: str | None = None,
    dtype: str | None = None,
    seed: int = 0,
    family: str | None = None,
    new_tokens: int = 32,
    progress: Callable[[str], None] | None = None,
    cache_checks: bool = True,
    tolerance: Tolerance | None = None,
) -> Report:
    say = progress or (lambda _line: None)
    ckpt = open_checkpoint(checkpoint, family)
    require_generated(ckpt.family)
    dev = torch.device(device or default_device())
    dt = parse_dtype(dtype, dev)
    tol = tolerance or Tolerance.for_dtype(dt)
    torch.manual_seed(seed)
    say(f"parity: loading {ckpt.family.name} from {ckpt.path} into dayzero ({dev.type}/{dt})")
    ours = Ours(ckpt, dev, dt)
    say(f"parity: loading the reference {ckpt.family.spec.spec.reference}")
    with tempfile.TemporaryDirectory(prefix="dayzero-dequant-") as tmp:  # read whole by from_pretrained
        folder = write_dequantized(ckpt, Path(tmp)) if ckpt.packing else ckpt.folder
        ref = Reference(ckpt, folder, dev, dt)
        base = None if tol.exact else Reference(ckpt, folder, dev, torch.float32)  # bf16: judge vs fp32
    windows = [g.window for g in ours.cfg.cache_groups if g.window]
    prompts = make_prompts(ours.cfg.embedding.vocab, seed, window=max(windows, default=None))
    ours.roomy([len(p) + new_tokens for p in prompts])
    total = len(CHECKS) if cache_checks else 3
    report = Report(ckpt.family.name, dev.type, str(dt).removeprefix("torch."))

    # 1. prefill logits at every position, all prompts in one batch
    with _check(report, CHECKS[0], say, total):
        ours_logits = ours.prefill_logits(prompts)
        ref_logits = [ref.logits(p) for p in prompts]
        errs = [(a - b).abs().max().item() for a, b in zip(ours_logits, ref_logits, strict=True)]
        worst = int(np.argmax(errs))
        scale = max(b.abs().max().item() for b in ref_logits)
        lengths = f"{min(map(len, prompts))}..{max(map(len, prompts))}"
        note = f"{len(prompts)} prompts, lengths {lengths}, |logit| <= {scale:.1f}"
        if base is None:
            row = Row(CHECKS[0], max(errs) <= tol.logits, logit_err=max(errs), note=note)
            if not row.ok:  # fp32's own rounding, amplified through the model? both against fp64
                exact = ref.widened()
                truth = [exact.logits(p) for p in prompts]
                del exact
                e_ours, e_ref = _worst(ours_logits, truth), _worst(ref_logits, truth)
                row.ok = tol.second_opinion(e_ours, e_ref)
                row.note += f"; vs fp64: dayzero {e_ours:.3e}, reference fp32 {e_ref:.3e}"
        else:
            fp32 = [base.logits(p) for p in prompts]
            e_ours, e_ref = _worst(ours_logits, fp32), _worst(ref_logits, fp32)
            row = Row(
                CHECKS[0],
                e_ours <= tol.ratio * e_ref + tol.slack,
                logit_err=e_ours,
                note=f"vs fp32; reference {report.dtype} {e_ref:.3e}; vs reference {max(errs):.3e}; {note}",
            )
        report.rows.append(row)

    # 2. greedy, one prompt at a time
    greedy = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    with _check(report, CHECKS[1], say, total):
        if base is None:
            expected = Expected([ref.greedy(p, new_tokens) for p in prompts])
        else:  # the fp32 sequences, and how the reference in the low precision keeps to them
            fp32, top = zip(*(base.greedy_top(p, new_tokens) for p in prompts), strict=True)
            own = [ref.greedy(p, new_tokens) for p in prompts]
            expected = Expected(list(fp32), list(top))
            expected.reference_agreement = agreement(own, expected.tokens)[0]
            expected.reference_gap = divergence_gap(own, expected.tokens, expected.top)
        solo = []
        for p in prompts:
            solo += ours.engine(max_batch_size=1).generate([p], greedy)
        report.rows.append(compare(solo, expected, tol, CHECKS[1]))

    # 3. one mixed batch, chunk smaller than the prompts
    with _check(report, CHECKS[2], say, total):
        shortest = min(map(len, prompts))
        chunk = max(2, shortest - 1)
        eng = ours.engine(chunk_size=chunk, max_tokens_per_step=2 * chunk + len(prompts), block_size=4)
        outs = eng.generate(prompts, greedy)
        note = f"chunk {chunk}, {eng.stats['steps']} steps"
        report.rows.append(compare(outs, expected, tol, CHECKS[2], note))

    if cache_checks:  # 4.-6. what the cache does: the weights' format does not reach it
        # 4. prefix-cache hits: the same prompts again in the same engine
        with _check(report, CHECKS[3], say, total):
            before = eng.scheduler.prefix_stats()["hit_tokens"]
            second = eng.generate(prompts, greedy)
            hits = eng.scheduler.prefix_stats()["hit_tokens"] - before
            row = compare(second, expected, tol, CHECKS[3], f"{hits} tokens from cache")
            row.ok = row.ok and hits > 0
            report.rows.append(row)

        # 5./6. forced retraction: KV memory for the longest request alone, with host memory for
        # every request's blocks, then with none (retracted requests recompute)
        batch = len(prompts)
        budget = retraction_budget(eng.groups, [len(p) + new_tokens for p in prompts], batch)
        for label, host in ((CHECKS[4], budget * batch), (CHECKS[5], 0)):
            with _check(report, label, say, total):
                e = ours.engine(
                    kv_cache_bytes=budget,
                    max_batch_size=batch,
                    host_cache_bytes=host,
                    prefix_cache=False,
                    **RETRACTION,
                )
                outs = e.generate(prompts, greedy)
                note = f"{e.stats['retracted']} retractions, KV {budget / 2**20:.2f} MiB"
                row = compare(outs, expected, tol, label, note)
                row.ok = row.ok and e.stats["retracted"] > 0
                report.rows.append(row)

    if not report.ok:
        failing = prompts[worst]
        layer_tol = tol.logits if tol.exact else 0.1  # low precision: 10% of the layer's scale
        report.layer_diff = layer_diff(
            ours.model,
            ref.model,
            lambda: (ref.logits(failing), ours.prefill_logits([failing])),
            ckpt.family.spec.spec.reference_modules,
            ckpt.mapping.layers,
            [(layer.attn_kind, layer.mlp_kind) for layer in ours.cfg.layers],
            layer_tol,
        )
    return report
