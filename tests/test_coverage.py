"""docs/coverage.md is the rendering of the survey (sdk/codegen/coverage.yaml) and of the parity
records `dayzero coverage` measured on the current specs (`dayzero coverage --check`, run here:
nothing is measured, a changed spec without a new measurement fails)."""

from __future__ import annotations

import dataclasses

from dayzero.sdk.codegen import coverage


def test_the_table_is_current() -> None:
    found = coverage.problems(coverage.survey(), coverage.load_records())
    assert not found, "\n".join([*found, "run `dayzero coverage` (it measures the stale families)"])


def test_a_changed_spec_makes_its_record_stale() -> None:
    entries, records = coverage.survey(), coverage.load_records()
    fam = next(f for e in entries if (f := coverage.family_of(e)) is not None)
    records[fam.name] = dataclasses.replace(records[fam.name], spec_hash="0" * 12)
    found = coverage.problems(entries, records)
    assert any(line.startswith(f"{fam.name}: measured on spec.yaml@000000000000") for line in found)


def test_every_surveyed_architecture_has_a_status() -> None:
    for e in coverage.survey():
        served = coverage.family_of(e) is not None
        assert served != bool(e.needs or e.out_of_scope), e.cls
