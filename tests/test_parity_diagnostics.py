"""A parity failure is reported as a failure, with a layer diff naming the first diverging block."""

from __future__ import annotations

import re

import torch

from dayzero.kernels.registry import KERNELS, Capabilities, Kernel
from dayzero.sdk.parity import run_parity
from dayzero.sdk.parity.tiny import write_tiny


def test_a_wrong_kernel_fails_parity_and_the_diff_names_its_block(tmp_path, monkeypatch):
    ckpt = write_tiny("llama", tmp_path / "ckpt", seed=2, overrides={"num_hidden_layers": 2})

    def off_by_a_bit(
        gate: torch.Tensor, up: torch.Tensor, fp32: bool = False, limit: float | None = None
    ) -> torch.Tensor:
        return torch.nn.functional.silu(gate) * up * 1.01  # a 1% error in every MLP

    caps = Capabilities(features=frozenset({"fp32"}), priority=100)  # outranks the reference
    monkeypatch.setitem(
        KERNELS._items, "swiglu/test_wrong", Kernel("swiglu", "test_wrong", off_by_a_bit, caps)
    )
    report = run_parity(ckpt, device="cpu", seed=2)
    assert not report.ok
    text = report.table()
    assert "prefill logits" in text and "FAIL" in text and text.endswith("parity FAILED")
    # past the fixed bound, the fp64 second opinion: dayzero far outside fp32's own rounding
    ours, ref = map(float, re.search(r"dayzero (\S+), reference fp32 (\S+)", report.rows[0].note).groups())
    assert not report.rows[0].ok and ours > 100 * ref, report.rows[0].note
    assert "first divergence: layer 0 mlp (swiglu block)" in text
    assert "layer   0 attention (gqa)" in text  # the attention before it matched


def test_the_retraction_budget_forces_retraction_on_a_model_of_sliding_windows() -> None:
    """Beam at its full size (52 layers, 43 of them 512-token sliding windows, the case where a
    budget of two whole-length requests held every prompt and retracted nothing): the budget
    holds the longest request alone, not the two longest together (so they must retract)."""
    from dayzero.sdk.engine.geometry import scheduler_groups
    from dayzero.sdk.families import FAMILIES
    from dayzero.sdk.parity.runner import make_prompts, retraction_budget
    from dayzero.sdk.spec.reference import reference_config

    fam = FAMILIES.get("beam")
    cfg = fam.config(reference_config(fam.spec.spec.reference, {}))
    groups = scheduler_groups(cfg, 2)  # bf16
    assert {g.window for g in groups} == {0, 512}
    lengths = sorted(len(p) + 32 for p in make_prompts(cfg.embedding.vocab, 0, window=512))

    def held(length: int) -> int:  # KV bytes a request of that length keeps resident, unpadded
        return sum(g.bytes_per_token * min(length, g.window or length) for g in groups)

    budget = retraction_budget(groups, lengths, len(lengths))
    assert held(lengths[-1]) <= budget < held(lengths[-1]) + held(lengths[-2])


def test_a_reference_that_misses_weights_is_refused_by_name(tmp_path):
    """A checkpoint the reference class cannot fully load (a tensor under a name it does not
    know) is refused naming the missing and the unused tensors, rather than comparing against
    the reference's random initialisation."""
    import pytest
    from safetensors.torch import load_file, save_file

    from dayzero.sdk.loader import open_checkpoint
    from dayzero.sdk.parity.runner import Reference

    path = write_tiny("llama", tmp_path / "ckpt", seed=1)
    sd = load_file(path / "model.safetensors")
    sd["model.norm.weight_renamed"] = sd.pop("model.norm.weight")
    save_file(sd, path / "model.safetensors")
    with pytest.raises(
        RuntimeError, match=r"did not find 1 of its weights .*: model\.norm\.weight; unused there: "
    ):
        Reference(open_checkpoint(path), path, torch.device("cpu"), torch.float32)
