"""What a family's real checkpoint needs, worked out from its config for the model card:
parameters (total and read per token), weight bytes per format, KV bytes per token, GPUs."""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass

import torch

from dayzero.kernels.packed import FORMATS
from dayzero.kernels.selection import OpTable

# bytes per parameter of a matrix as dayzero holds it in memory (kernels/packed.py)
MATRIX_BYTES = {"bf16": 2.0} | {name: fmt.bits / 8 for name, fmt in FORMATS.items()}
GPU_BYTES, GPU_NAME, USABLE = 141e9, "H200 (141 GB)", 0.85  # the rest: KV cache and activations


@dataclass(frozen=True)
class Needs:
    params: int
    active: int  # read per token: all but the unused routed experts and the embedding table
    weight_bytes: dict[str, float]
    kv_bytes_per_token: int
    state_bytes: int  # fixed-size recurrent state per request (linear attention), as kept
    sliding_kv: bool
    gpus: int  # for the release format, a power of two

    def line(self, fmt: str) -> str:
        sw = " (sliding-window layers stop growing at their window)" if self.sliding_kv else ""
        return (
            f"{self.params / 1e9:.2f}B parameters, {self.active / 1e9:.2f}B read per token; weights "
            f"{self.weight_bytes[fmt] / 1e9:.1f} GB in {fmt}"
            + (f" ({self.weight_bytes['bf16'] / 1e9:.1f} GB in bf16); " if fmt != "bf16" else "; ")
            + f"KV {self.kv_bytes_per_token / 1024:.0f} KiB per token in bf16{sw}; "
            + (
                f"recurrent state {self.state_bytes / 2**20:.1f} MiB per request; "
                if self.state_bytes
                else ""
            )
            + f"{self.gpus} x {GPU_NAME} at tensor-parallel size {self.gpus}"
        )


def needs(model_module, cfg, fmt: str, packed: dict[str, str] | None = None) -> Needs:
    """`packed`: parameter-name patterns -> format, the release's own scope; its bytes are then
    the `fmt` entry (every other matrix in bf16). None: every matrix in each format."""
    with torch.device("meta"):
        model = model_module.Model(cfg, OpTable(torch.device("cpu"), torch.bfloat16))  # shapes only
    total = sum(p.numel() for p in model.parameters())
    embed = model.embed.weight.numel()
    routed = [m.routed() for m in model.modules() if hasattr(m, "routed")]
    unused = sum(n * (1 - used) for n, used in routed)
    matrices = sum(
        p.numel() for n, p in model.named_parameters() if p.dim() >= 2 and not n.startswith("embed")
    )
    weight = {f: (total - matrices) * 2 + matrices * b for f, b in MATRIX_BYTES.items()}
    if packed:
        weight[fmt] = sum(
            p.numel()
            * MATRIX_BYTES[next((f for pat, f in packed.items() if fnmatch.fnmatchcase(n, pat)), "bf16")]
            for n, p in model.named_parameters()
        )
    kv = sum(g.row for g in cfg.cache_groups if g.kind != "state") * 2
    state = sum(g.row for g in cfg.cache_groups if g.kind == "state")
    gpus = 2 ** math.ceil(math.log2(max(1.0, weight[fmt] / (GPU_BYTES * USABLE))))
    sliding = any(g.window for g in cfg.cache_groups)
    return Needs(total, int(total - embed - unused), weight, kv, state, sliding, gpus)
