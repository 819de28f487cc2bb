"""Codegen: generated files, staleness, and the model card's worked-out hardware needs."""

from __future__ import annotations

import shutil
from pathlib import Path

from dayzero.sdk import codegen
from dayzero.sdk.codegen.hardware import needs
from dayzero.sdk.families import FAMILIES, MODELS_DIR, Family
from dayzero.sdk.spec.reference import reference_config


def test_a_new_family_folder_is_generated_then_current_then_stale_after_a_spec_edit(tmp_path: Path) -> None:
    folder = tmp_path / "llama2"
    folder.mkdir()
    shutil.copy(MODELS_DIR / "llama" / "spec.yaml", folder / "spec.yaml")
    fam = Family("llama", folder / "spec.yaml")
    assert sorted(p.name for p in codegen.stale(fam)) == sorted(codegen.OUTPUTS)
    codegen.write(fam)
    assert codegen.stale(fam) == []
    for name in codegen.OUTPUTS:
        text = (folder / name).read_text()
        assert text.startswith(("# generated from spec.yaml@", "<!-- generated from spec.yaml@")), name
    assert len((folder / "model.py").read_text().splitlines()) < 150  # a composition of blocks
    (folder / "spec.yaml").write_text(
        (folder / "spec.yaml").read_text().replace("title: Llama", "title: Llama 2")
    )
    fresh = Family("llama", folder / "spec.yaml")
    assert {p.name for p in codegen.stale(fresh)} == set(codegen.OUTPUTS)  # the hash in every header moved


def test_beam_release_needs_match_its_name() -> None:
    """Reflection Beam 1.0 is 501B-A23B: the card's numbers are worked out from BeamConfig()."""
    fam = FAMILIES.get("beam")
    cfg = fam.config(reference_config(fam.spec.spec.reference, {}))
    n = needs(fam.module("model"), cfg, "nvfp4")
    assert abs(n.params - 501e9) / 501e9 < 0.01
    assert 22e9 < n.active < 24e9  # "A23B"
    assert n.weight_bytes["nvfp4"] < 0.3 * n.weight_bytes["bf16"]
    assert n.gpus == 4
    card = (MODELS_DIR / "beam" / "README.md").read_text()
    assert "dayzero serve reflection/Beam-1.0-501B-A23B --quantization nvfp4 --tensor-parallel-size 4" in card
    assert "dayzero tiny beam /tmp/beam-tiny && dayzero serve /tmp/beam-tiny" in card
