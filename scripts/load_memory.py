"""Peak host memory while loading a checkpoint into dayzero (CPU, the model's dtype).

Prints the model's own bytes, the largest checkpoint tensor, and the peak resident memory
above the process baseline (taken after imports and model allocation, before any weight is
read). The loader's claim: peak - baseline <= largest tensor + a bounded buffer.

usage: python scripts/load_memory.py CHECKPOINT [--dtype float32]
"""

from __future__ import annotations

import argparse
import resource
import sys
import threading
import time

import torch


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def largest_tensor_bytes(ckpt) -> int:
    """From the headers alone (GGUF tensors count as dequantized fp32)."""
    if ckpt.format == "gguf":
        import gguf

        return max(int(t.n_elements) * 4 for t in gguf.GGUFReader(ckpt.path).tensors)
    from dayzero.sdk.loader.safetensors_io import read_header, shard_files

    return max(t.end - t.begin for f in shard_files(ckpt.path) for t in read_header(f))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    from dayzero.sdk.api import parse_dtype
    from dayzero.sdk.families import build
    from dayzero.sdk.loader import load_weights, open_checkpoint

    dtype = parse_dtype(args.dtype, torch.device("cpu"))
    ckpt = open_checkpoint(args.checkpoint)
    cfg = ckpt.family.config(ckpt.hf, str(ckpt.path))
    model, _ = build(ckpt.family, cfg, ckpt.hf, torch.device("cpu"), dtype)
    for p in model.parameters():  # touch every page: the weights are resident before loading
        p.data.zero_()
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = largest_tensor_bytes(ckpt)
    base = rss()
    peak = [base]
    done = threading.Event()

    def sample() -> None:  # resident memory every 2 ms while loading
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.002)

    t = threading.Thread(target=sample)
    t.start()
    load_weights(model, ckpt, progress=False)
    done.set()
    t.join()
    over = max(peak[0], rss()) - base
    mib = 1 << 20
    print(f"checkpoint {ckpt.path} ({ckpt.format})")
    print(f"model weights {model_bytes / mib:.1f} MiB; largest tensor (as loaded) {largest / mib:.1f} MiB")
    print(f"resident before loading {base / mib:.1f} MiB; peak above that while loading {over / mib:.1f} MiB")
    print(f"load_peak_over_baseline_mib {over / mib:.1f} largest_tensor_mib {largest / mib:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
