"""Peak host memory while loading stays within the model plus the largest tensor and a small buffer.

Measured in a fresh process (scripts/load_memory.py samples resident memory every 2 ms while
the weights stream in, above the baseline of the allocated model).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from dayzero.sdk.parity.tiny import write_tiny

BUFFER_MIB = 48  # allowance for reader/check temporaries and allocator slack


def test_loading_peaks_at_the_largest_tensor_plus_a_bounded_buffer(tmp_path):
    big = {
        "vocab_size": 16384,
        "hidden_size": 512,
        "intermediate_size": 1024,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "num_hidden_layers": 2,
    }  # 32 MiB embedding and lm_head, fp32
    ckpt = write_tiny("llama", tmp_path / "ckpt", seed=0, overrides=big)
    script = Path(__file__).resolve().parents[1] / "scripts" / "load_memory.py"
    r = subprocess.run([sys.executable, str(script), str(ckpt)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    m = re.search(r"load_peak_over_baseline_mib ([\d.]+) largest_tensor_mib ([\d.]+)", r.stdout)
    assert m, r.stdout
    peak, largest = float(m[1]), float(m[2])
    assert largest == 32.0
    assert peak <= largest + BUFFER_MIB, r.stdout
