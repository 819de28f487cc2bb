#!/usr/bin/env bash
# GPU bring-up on the lent H200 (see docs/benchmarks.md): build dayzero against the machine's
# torch, run Beam parity in fp32 and bf16 on CUDA, then `dayzero bench decode`.
# Wheels for packages the machine lacks (transformers 5.23, pydantic) travel in .whl/.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
DZ="python3 -m dayzero.sdk.cli"
TMP=$(mktemp -d)
MED='{"hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 8, "num_attention_heads": 16,
 "num_key_value_heads": 4, "head_dim": 64, "moe_intermediate_size": 512, "num_experts": 32,
 "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2, "sliding_window": 64, "vocab_size": 4096}'
$DZ tiny beam "$TMP/medium" --seed 3 --set "$MED" >/dev/null
PARITY=${PARITY:-"tiny-fp32 tiny-bf16 medium-fp32 medium-bf16"}
for which in $PARITY; do
  size=${which%-*}; dtype=${which#*-}; [ "$dtype" = bf16 ] && dtype=bfloat16 || dtype=float32
  [ "$size" = tiny ] && args="beam" || args="--checkpoint $TMP/medium --seed 3"
  spec="$which:$args --device cuda --dtype $dtype"
  echo "== parity ${spec%%:*}"
  $DZ parity ${spec#*:} 2>&1 | grep -v "Loading weights" | tee -a "$OUT/parity.log"
done
echo "== bench decode"
$DZ bench decode --layers 8 --experts 64 --batches 1,32 --prompt-len 512 --new-tokens 64 2>&1 \
  | grep -v "loading weights" | tee "$OUT/bench.log"
