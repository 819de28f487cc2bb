"""The non-gated feed-forward block: one up-projection, an activation, one down-projection."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from dayzero.kernels.selection import OpTable
from dayzero.sdk.blocks.base import BLOCKS, BlockDef
from dayzero.sdk.config.model import ONE_RANK, Parallel, Slice
from dayzero.sdk.config.options import BoolV, IntV, Ref, Strict

# a(h) elementwise, in h's dtype as transformers' ACT2FN applies it
PLAIN_ACTIVATIONS = {
    "relu2": lambda h: torch.square(F.relu(h)),  # Arcee, Nemotron
    "gelu_pytorch_tanh": lambda h: F.gelu(h, approximate="tanh"),
    "gelu": F.gelu,  # the erf form
    "silu": F.silu,
}


class PlainMlpOpts(Strict):
    kind: Literal["mlp"]
    intermediate: IntV
    # the activation, or a $symbol reading it from the config (hidden_act)
    activation: Literal["relu2", "gelu_pytorch_tanh", "gelu", "silu"] | Ref = "gelu_pytorch_tanh"
    bias: BoolV = False  # biases on both projections


@dataclass(frozen=True)
class PlainMlpCfg:
    hidden: int
    intermediate: int  # this rank's, when sharded
    act: str
    bias: bool
    par: Parallel = ONE_RANK


class PlainMLP(nn.Module):
    """y = W_down a(W_up x + b_up) + b_down, a one of PLAIN_ACTIVATIONS (relu2: relu(h)^2).
    Tensor parallel over P ranks: each holds I / P of the intermediate (rows of W_up and b_up,
    columns of W_down); y = sum over ranks of its partial product (all-reduce), then b_down."""

    linear_weights = ("up", "down")  # may be packed

    def __init__(self, cfg: PlainMlpCfg, ops: OpTable) -> None:
        super().__init__()
        self.cfg, self.ops = cfg, ops
        self.up = nn.Parameter(torch.empty(cfg.intermediate, cfg.hidden))
        self.down = nn.Parameter(torch.empty(cfg.hidden, cfg.intermediate))
        self.up_bias = nn.Parameter(torch.empty(cfg.intermediate)) if cfg.bias else None
        self.down_bias = nn.Parameter(torch.empty(cfg.hidden)) if cfg.bias else None

    @staticmethod
    def shards(cfg: PlainMlpCfg) -> dict[str, dict[str, Slice]]:
        if cfg.par.size == 1:
            return {}
        rows = Slice(-2, cfg.par.rank * cfg.intermediate, cfg.intermediate)
        out = {"up": {"": rows}, "down": {"": Slice(-1, rows.start, rows.length)}}
        return out | ({"up_bias": {"": Slice(-1, rows.start, rows.length)}} if cfg.bias else {})

    def forward(self, x: torch.Tensor, rows: tuple[int, ...] | None = None) -> torch.Tensor:
        """x [T, Dm] -> [T, Dm]; rows: as SwiGLU's (this rank's rows of the sum over ranks)."""
        c, ops = self.cfg, self.ops
        h = PLAIN_ACTIVATIONS[c.act](ops.linear(x, self.up, self.up_bias))  # [T, I]
        if c.par.size == 1:
            return ops.linear(h, self.down, self.down_bias)
        y = ops.tp.reduce(ops.linear(h, self.down), rows)  # [T, Dm] (or this rank's rows) summed over ranks
        return y if self.down_bias is None else y + self.down_bias


def _resolve(o: PlainMlpOpts, val) -> PlainMlpCfg:
    act = val(o.activation)
    if act not in PLAIN_ACTIVATIONS:
        known = ", ".join(PLAIN_ACTIVATIONS)
        raise ValueError(f"activation {act!r} is not implemented by the plain MLP; known: {known}")
    return PlainMlpCfg(int(val("$hidden")), int(val(o.intermediate)), str(act), bool(val(o.bias)))


def _shard(c: PlainMlpCfg, par: Parallel) -> PlainMlpCfg:
    return dataclasses.replace(c, intermediate=par.even(c.intermediate, "the MLP intermediate"), par=par)


def _needs(c: PlainMlpCfg):
    return [("linear", frozenset({"bias"}) if c.bias else frozenset(), None)]


_DEF = BlockDef("mlp", "mlp", PlainMlpOpts, _resolve, PlainMLP, _needs, doc=PlainMLP.__doc__, shard=_shard)
BLOCKS.add("mlp", _DEF)
