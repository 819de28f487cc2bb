"""`dayzero bench decode`'s CPU-testable parts: the reference weights under their checkpoint
names, and the bytes a decode step reads (the roofline's numerator)."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from dayzero.sdk.bench.decode import bytes_per_step, checkpoint_tensors
from dayzero.sdk.loader import open_checkpoint
from dayzero.sdk.parity.runner import Ours
from dayzero.sdk.parity.tiny import write_tiny
from dayzero.sdk.spec.reference import reference_class


@pytest.mark.parametrize("family", ["beam", "glm53", "glm53_flash"])
def test_in_memory_reference_tensors_carry_checkpoint_names(tmp_path, family: str) -> None:
    path = write_tiny(family, tmp_path / "ckpt", seed=0)
    ref = reference_class(open_checkpoint(path).family.spec.spec.reference).from_pretrained(path)
    saved = safe_open(str(path / "model.safetensors"), "pt")
    got = dict(checkpoint_tensors(ref))
    assert set(got) == set(saved.keys())
    for name in list(got)[:20]:
        assert torch.equal(got[name], saved.get_tensor(name)), name


def test_decode_bytes_count_weights_experts_and_cache(tmp_path) -> None:
    ckpt = open_checkpoint(write_tiny("glm53_flash", tmp_path / "ckpt", seed=0))
    ours = Ours(ckpt, torch.device("cpu"), torch.float32)
    one, total, active = bytes_per_step(ours.cfg, ours.model, prompt_len=100)
    assert active < total - ours.model.embed.weight.numel()  # unused experts are not read
    two = bytes_per_step(ours.cfg, ours.model, prompt_len=200)[0]
    paged = sum(g.row for g in ours.cfg.cache_groups if g.kind != "state")
    assert two - one == pytest.approx(paged * 2 * 100)  # 100 more cached positions, bf16
    many = bytes_per_step(ours.cfg, ours.model, prompt_len=100, batch=64)[0]
    assert many > one  # more experts touched, 64 requests' caches
