"""A quantized checkpoint tensor whose rule cuts it into parts by whole rows (split,
split_heads: Qwen3.5's fused in_proj_qkv and its per-head [q; gate] q_proj): each stored
component is cut by the same rows (sdk/quant/layout.py take_rows), scalars kept whole, fp8_block
scales by the block their rows come from; a transform that does more than move rows, or a part
whose rows straddle fp8 blocks, is refused naming the tensor. End to end: Qwen3.8's tiny quantized
by ModelOpt (NVFP4) passes parity (the reference on the dequantized weights)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dayzero.sdk.errors import WeightError
from dayzero.sdk.parity import run_parity
from dayzero.sdk.parity.quantized_tiny import write_quantized_tiny
from dayzero.sdk.quant.layout import take_rows
from dayzero.sdk.transforms import bind


def test_rows_of_codes_and_scales_follow_a_split_by_head() -> None:
    """split_heads of 2 heads x [q 4 rows; gate 4 rows]: NVFP4 codes (two a byte) and per-16
    scales take the q rows 0-3, 8-11 and the gate rows 4-7, 12-15; the global scale stays."""
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 255, (16, 8), dtype=torch.uint8, generator=g)  # [R, K / 2]
    scale = torch.rand(16, 1, generator=g)  # [R, K / 16]
    heads = bind("split_heads", {"heads": 2, "sizes": [4, 4]})
    q_rows, gate_rows = (p.flatten().long().tolist() for p in heads(torch.arange(16.0)[:, None]))
    assert q_rows == [0, 1, 2, 3, 8, 9, 10, 11] and gate_rows == [4, 5, 6, 7, 12, 13, 14, 15]
    for rows in (q_rows, gate_rows):
        assert torch.equal(take_rows("modelopt", "nvfp4", "codes", codes, rows, "w"), codes[rows])
        assert torch.equal(take_rows("modelopt", "nvfp4", "scale", scale, rows, "w"), scale[rows])
    glob = torch.tensor(0.5)
    assert take_rows("modelopt", "nvfp4", "global", glob, q_rows, "w") is glob


def test_fp8_block_scales_follow_their_rows_or_are_refused() -> None:
    scale = torch.arange(6.0).view(3, 2)  # 3 blocks of 128 rows, 2 of 128 columns
    # a part of rows 128..255 takes block 1; one of 32 rows inside block 2 takes block 2
    assert torch.equal(
        take_rows("modelopt", "fp8_block", "scale", scale, list(range(128, 256)), "w"), scale[1:2]
    )
    assert torch.equal(
        take_rows("modelopt", "fp8_block", "scale", scale, list(range(300, 332)), "w"), scale[2:3]
    )
    four = scale[:, None, :, None]  # ModelOpt's [rb, 1, kb, 1]
    assert torch.equal(take_rows("modelopt", "fp8_block", "scale", four, list(range(256)), "w"), scale[:2])
    with pytest.raises(WeightError, match=r"checkpoint tensor w: a part's rows 64\.\.191 come from several"):
        take_rows("modelopt", "fp8_block", "scale", scale, list(range(64, 192)), "w")


def test_qwen38_nvfp4_passes_parity_through_split_packed_weights(tmp_path: Path) -> None:
    ckpt = write_quantized_tiny("qwen38", tmp_path / "ckpt", "nvfp4", "modelopt", seed=5)
    report = run_parity(ckpt, device="cpu", seed=5, new_tokens=8)
    assert report.ok, report.table()
