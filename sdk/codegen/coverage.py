"""`dayzero coverage`: the measured coverage of transformers' decoder-only text architectures.

The survey (`sdk/codegen/coverage.yaml`) lists each architecture (model_type, class, kind) and,
for one no family serves, what it needs: `needs` (the block or option it lacks) or `out_of_scope`
(why). Whether an architecture passes is never written there: the family whose spec claims its
class and model_type (`models/<f>/spec.yaml`) is measured, by the light parity its generated
test runs in CI (the tiny config written through the reference class, seed 0, every check of
`run_parity`, the spec's `parity.new_tokens`). The results are kept in `docs/coverage.json` (one
record a family: its spec hash, transformers' version, the checks, the errors) and rendered into
`docs/coverage.md`.

`dayzero coverage` measures the families whose record is missing or stale (another spec hash or
transformers version), or those named, and rewrites both files; `--check` measures nothing and
fails when a record is stale, a surveyed architecture's family changed, a family is not in the
survey, or the table is not the rendering of the survey and the records.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Literal

import torch
import transformers
import yaml
from pydantic import model_validator

from dayzero.sdk.config.options import Strict
from dayzero.sdk.families import FAMILIES, Family
from dayzero.sdk.parity import run_parity
from dayzero.sdk.parity.tiny import write_tiny

ROOT = Path(__file__).resolve().parents[2]
SURVEY = Path(__file__).with_name("coverage.yaml")
RECORDS = ROOT / "docs" / "coverage.json"
TABLE = ROOT / "docs" / "coverage.md"
SEED = 0  # the generated test's first seed (templates/test_parity.py.j2)


class Entry(Strict):
    """One surveyed architecture: a family serves it, or it says what it needs or why not."""

    model_type: str
    cls: str
    kind: Literal["dense", "moe", "hybrid", "sliding", "mla"]
    needs: str | None = None
    out_of_scope: str | None = None
    note: str | None = None  # a served architecture's limits (what its spec refuses)

    @model_validator(mode="after")
    def _one_reason(self) -> Entry:
        if self.needs and self.out_of_scope:
            raise ValueError(f"{self.cls}: give needs or out_of_scope, not both")
        return self


@dataclass(frozen=True)
class Record:
    """One family's measured light parity."""

    family: str
    spec_hash: str
    transformers: str
    ok: bool
    checks: list[str]  # each check run, with its result
    logit_err: float
    logprob_err: float
    new_tokens: int
    seconds: float


def survey() -> list[Entry]:
    rows = yaml.safe_load(SURVEY.read_text())
    entries = [Entry(**{("cls" if k == "class" else k): v for k, v in r.items()}) for r in rows]
    seen: set[str] = set()
    for e in entries:
        if e.cls in seen:
            raise ValueError(f"{SURVEY}: {e.cls} is listed twice")
        seen.add(e.cls)
        ref = getattr(transformers, e.cls, None)
        if ref is None or ref.config_class.model_type != e.model_type:
            raise ValueError(f"{SURVEY}: {e.cls} is not transformers' {e.model_type} class")
    return entries


def family_of(e: Entry) -> Family | None:
    """The in-tree family whose spec claims this class and model_type."""
    return next(
        (
            f
            for _, f in FAMILIES.items()
            if f.in_tree and e.cls in f.spec.spec.architectures and e.model_type in f.spec.spec.model_types
        ),
        None,
    )


def spec_lines(fam: Family) -> int:
    """The spec's lines of YAML: blank and comment-only lines not counted."""
    lines = fam.spec_path.read_text().splitlines()
    return sum(1 for ln in lines if ln.strip() and not ln.lstrip().startswith("#"))


def measure(fam: Family) -> Record:
    """The family's generated test, first case: its tiny config, seed 0, on CPU in fp32."""
    tokens = fam.spec.spec.parity.new_tokens
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dayzero-coverage-") as tmp:
        ckpt = write_tiny(fam.name, Path(tmp) / "ckpt", seed=SEED)
        report = run_parity(ckpt, device="cpu", seed=SEED, new_tokens=tokens)
    errs = [r.logit_err for r in report.rows if r.logit_err is not None]
    lps = [r.logprob_err for r in report.rows if r.logprob_err is not None]
    return Record(
        family=fam.name,
        spec_hash=fam.spec.hash,
        transformers=transformers.__version__,
        ok=report.ok,
        checks=[f"{r.check}: {'ok' if r.ok else 'FAIL'}" for r in report.rows],
        logit_err=max(errs, default=0.0),
        logprob_err=max(lps, default=0.0),
        new_tokens=tokens,
        seconds=round(time.perf_counter() - t0, 1),
    )


def load_records() -> dict[str, Record]:
    if not RECORDS.exists():
        return {}
    return {r["family"]: Record(**r) for r in json.loads(RECORDS.read_text())}


def stale_record(fam: Family, rec: Record | None) -> str | None:
    if rec is None:
        return "never measured"
    if rec.spec_hash != fam.spec.hash:
        return f"measured on spec.yaml@{rec.spec_hash}, now @{fam.spec.hash}"
    if rec.transformers != transformers.__version__:
        return f"measured with transformers {rec.transformers}, now {transformers.__version__}"
    return None


def _status(e: Entry, fam: Family | None, rec: Record | None) -> str:
    if fam is None:
        return f"needs {e.needs}" if e.needs else f"out of scope: {e.out_of_scope}"
    if rec is None or not rec.ok:
        failed = [c for c in (rec.checks if rec else []) if c.endswith("FAIL")]
        return f"spec `{fam.folder}`: parity FAILS ({'; '.join(failed) or 'not measured'})"
    p = fam.spec.spec.parity
    ci = f"{p.seeds} seed(s) x {1 + len(fam.spec.spec.shapes)} config(s)" + (
        ", quantized layouts" if p.quantized else ""
    )
    note = f"; {e.note}" if e.note else ""
    return f"passes from a spec alone: `models/{fam.folder}/test_parity.py` in CI ({ci}){note}"


def render(entries: list[Entry], records: dict[str, Record]) -> str:
    rows, passing, kinds = [], 0, {}
    for e in entries:
        fam = family_of(e)
        rec = records.get(fam.name) if fam else None
        ok = fam is not None and rec is not None and rec.ok
        passing += ok
        kinds.setdefault(e.kind, [0, 0])[0] += ok
        kinds[e.kind][1] += 1
        cells = [
            f"`{e.model_type}`",
            e.cls,
            e.kind,
            _status(e, fam, rec),
            str(spec_lines(fam)) if fam else "-",
            f"{rec.logit_err:.1e}" if ok else "-",
            f"{rec.logprob_err:.1e}" if ok else "-",
            f"{sum(c.endswith(': ok') for c in rec.checks)}/{len(rec.checks)}" if rec else "-",
        ]
        rows.append("| " + " | ".join(cells) + " |")
    head = [
        "<!-- generated by `dayzero coverage` from sdk/codegen/coverage.yaml; do not edit -->",
        "# Coverage of transformers' decoder-only text architectures",
        "",
        f"transformers {transformers.__version__}: **{passing} of {len(entries)} surveyed architectures pass "
        "parity from a spec alone** (`models/<family>/spec.yaml`, generated code, no family-specific "
        "Python); "
        + ", ".join(f"{k}: {p} of {n}" for k, (p, n) in kinds.items())
        + f"; {sum(bool(e.needs) for e in entries)} need a block or option, "
        f"{sum(bool(e.out_of_scope) for e in entries)} out of scope.",
        "",
        "Measured, never typed: `dayzero coverage` writes each family's tiny config through the "
        "transformers class, runs `dayzero.sdk.parity.run_parity` on it on CPU in fp32 (seed 0; the "
        "checks: prefill logits, greedy one by one, mixed chunked batch, prefix-cache hits, retraction "
        "to host and by recompute) and records the result with the spec's hash (`docs/coverage.json`); "
        "`dayzero coverage --check` fails when a record is stale or this table is not their rendering. "
        "CI runs the same case (and more, per the spec's `parity` option) in each family's generated "
        "`test_parity.py`. Errors: max |dlogit| of the prefill and max |dlogprob| of the greedy checks.",
        "",
        "| model_type | class | kind | status | spec lines | max\\|dlogit\\| | max\\|dlogprob\\| | checks |",
        "|---|---|---|---|---|---|---|---|",
    ]
    return "\n".join(head + rows) + "\n"


def problems(entries: list[Entry], records: dict[str, Record]) -> list[str]:
    """What `--check` fails on (nothing measured)."""
    out = []
    claimed = {f.name for e in entries if (f := family_of(e)) is not None}
    for e in entries:
        fam = family_of(e)
        if fam is not None and (why := stale_record(fam, records.get(fam.name))):
            out.append(f"{fam.name}: {why} (run `dayzero coverage`)")
        if fam is None and not (e.needs or e.out_of_scope):
            out.append(f"{e.cls}: no family serves it and the survey says neither needs nor out_of_scope")
        if fam is not None and (e.needs or e.out_of_scope):
            out.append(f"{e.cls}: served by {fam.name}, but the survey still says what it needs")
    for name, f in FAMILIES.items():  # the survey is of transformers' classes
        if f.in_tree and name not in claimed and f.spec.spec.config_class is None:
            out.append(f"{name}: a family whose architecture the survey ({SURVEY.name}) does not list")
    if not TABLE.exists() or TABLE.read_text() != render(entries, records):
        out.append(f"{TABLE}: not the rendering of the survey and the records (run `dayzero coverage`)")
    return out


def _measure_named(name: str) -> Record:
    """measure() in a worker; a family that fails to build or run is a failing record, named."""
    torch.set_num_threads(1)  # one process a family (--jobs): no oversubscribed cores
    fam = FAMILIES.get(name)
    try:
        return measure(fam)
    except Exception as e:  # the table shows it failing, with the error; other families go on
        return Record(
            name,
            fam.spec.hash,
            transformers.__version__,
            False,
            [f"error: {type(e).__name__}: {e} FAIL"],
            0.0,
            0.0,
            fam.spec.spec.parity.new_tokens,
            0.0,
        )


def _write(entries: list[Entry], records: dict[str, Record]) -> None:
    served = {f.name for e in entries if (f := family_of(e)) is not None}
    kept = [asdict(records[k]) for k in sorted(records) if k in served]
    RECORDS.write_text(json.dumps(kept, indent=1) + "\n")
    TABLE.write_text(render(entries, records))


def update(families: list[str] | None, jobs: int, say: Callable[[str], None]) -> list[str]:
    """Measure the named families (default: the surveyed ones whose record is stale), `jobs` at a
    time, writing the records and the table as each ends. Returns `--check`'s remaining problems."""
    entries, records = survey(), load_records()
    todo = [f.name for e in entries if (f := family_of(e)) is not None]
    if families:
        if unknown := sorted(set(families) - set(todo)):
            raise ValueError(f"not a surveyed architecture's family: {', '.join(unknown)}")
        todo = [n for n in todo if n in families]
    else:
        todo = [n for n in todo if stale_record(FAMILIES.get(n), records.get(n))]
    say(f"coverage: measuring {len(todo)} famil{'y' if len(todo) == 1 else 'ies'}, {jobs} at a time")
    with ProcessPoolExecutor(max_workers=max(1, jobs), mp_context=get_context("spawn")) as pool:
        running = {pool.submit(_measure_named, n): n for n in todo}
        for done in as_completed(running):
            rec = done.result()
            say(f"coverage: {rec.family}: {'ok' if rec.ok else 'FAIL'} in {rec.seconds} s")
            records[rec.family] = rec
            _write(entries, records)
    _write(entries, records)
    return problems(entries, records)
