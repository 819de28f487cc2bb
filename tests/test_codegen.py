"""Codegen: generated files, staleness, and the model card's worked-out hardware needs."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from dayzero.sdk import codegen
from dayzero.sdk.codegen.hardware import needs
from dayzero.sdk.codegen.spec_doc import render as render_doc
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


def test_kimi_k3_releases_count_only_what_each_packs() -> None:
    """Kimi K3's two releases (fact sheet section 4): MXFP4 holds only the routed experts packed,
    the NVFP4 one the experts in NVFP4 and the attention projections in FP8 blocks; the bytes
    of every other parameter stay bf16, and the card has both launch commands (two hosts)."""
    from dayzero.sdk.codegen.hardware import MATRIX_BYTES
    from dayzero.sdk.spec.reference import spec_config

    fam = FAMILIES.get("kimi_k3")
    cfg = fam.config(spec_config(fam.spec.spec, {}))
    mx, nv = fam.spec.spec.release
    a, b = (
        needs(fam.module("model"), cfg, "mxfp4", mx.packed),
        needs(fam.module("model"), cfg, "nvfp4", nv.packed),
    )
    experts = 92 * 896 * 3 * 3072 * 3584  # layers 1..92, gate / up / down of each expert
    assert a.params == b.params and abs(a.params - experts) / a.params < 0.03  # experts are ~98%
    rest = a.params - experts
    assert a.weight_bytes["mxfp4"] == pytest.approx(experts * MATRIX_BYTES["mxfp4"] + rest * 2, rel=1e-9)
    assert (
        experts * MATRIX_BYTES["nvfp4"] < b.weight_bytes["nvfp4"] < experts * MATRIX_BYTES["nvfp4"] + rest * 2
    )
    card = (MODELS_DIR / "kimi_k3" / "README.md").read_text()
    for rel, q in ((mx, "mxfp4"), (nv, "nvfp4")):
        assert (
            f"dayzero serve {rel.checkpoint} --quantization {q} --tensor-parallel-size 16 --nnodes 2" in card
        )


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


def test_the_spec_reference_documents_every_type_it_links() -> None:
    """docs/spec-reference.md: each `[Type](#type)` in a field table lands on that type's section
    (every model the schema reaches from Spec gets one, Release and the layer rules included)."""
    doc = render_doc()
    anchors = {h.strip().lower().replace(" ", "-").strip("`") for h in re.findall(r"^#+ (.*)$", doc, re.M)}
    links = set(re.findall(r"\]\(#([a-z0-9_-]+)\)", doc))
    assert {"release", "ruleindices", "ngramopts", "mtplayernames"} <= links
    assert links <= anchors, sorted(links - anchors)
    assert "| `label` |" in doc  # Release's fields are in the table


def test_a_release_label_heads_its_launch_line_in_place_of_the_default() -> None:
    """A release that is not the family's own names itself (Qwen3.8 serves the Qwen3.5
    architecture's checkpoint); one without a label keeps "The release checkpoint"."""
    qwen = codegen.render(FAMILIES.get("qwen38"))["README.md"]
    label = "The Qwen3.5 architecture's checkpoint"
    assert (
        f"{label} (transformers' default Qwen3_5MoeConfig" in qwen
        and "dayzero serve Qwen/Qwen3.5-35B-A3B" in qwen
    )
    assert "The release checkpoint" not in qwen.split("## Launch")[1].split("A tiny random")[0]
    glm = codegen.render(FAMILIES.get("glm53"))["README.md"]
    assert "The release checkpoint:\n\n```bash\ndayzero serve zai-org/GLM-5.3" in glm
