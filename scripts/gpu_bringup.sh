#!/usr/bin/env bash
# GPU bring-up on the lent H200 (see docs/benchmarks.md): build dayzero against the machine's
# torch, run GPU tests, parity on CUDA for medium random checkpoints, then `dayzero bench decode`.
#   TESTS: pytest files run first (e.g. "tests/test_triton_packed.py tests/test_triton_cuda.py
#   tests/test_mla_kernels.py tests/test_fla_bindings.py"; the last needs fla-core's wheel (and
#   einops') on PYTHONPATH: keep it out of .whl/, where it would also switch transformers' linear-
#   attention references to fla's kernels)
#   PARITY: "family:dtype ..." (dtype fp32 | bf16); QPARITY: "folder:dtype ..." for checkpoints
#   carried in (quantized ones are made here by ModelOpt: `dayzero tiny F OUT --quantization Q`)
#   TP_BENCH_FAMILIES: "family ..." benched on TP_BENCH GPUs ("1 2 4 8"; 1: the same path on one
#   GPU, the baseline; random weights: `bench decode --tensor-parallel-size N`; BENCH_FLAGS=--profile
#   adds the collectives' time a step, --release the release config's shapes)
#   TP: "2 4 8": each fp32 PARITY / QPARITY checkpoint also on N GPUs over NCCL against one GPU
#   (`dayzero parity --tensor-parallel-size N`: logits within 1e-4 of max|logit|, the same
#   greedy tokens, prefix hits and retractions); EP=1 adds the expert-parallel layout, DP=1
#   data-parallel attention (logits and tokens)
#   BENCH: "family ..."; QUANT: the weight formats to bench, "bf16 nvfp4 ..."; REPEAT: runs of each
#   (batch-1 rates swing between runs: report the median of three); AGENTIC: runs of `bench
#   agentic` (beam, one agent; TOKENIZER: a tokenizer folder, default .tok/: the embedded default's,
#   saved by tokenizer.save_pretrained); FLA: "1" runs tests/test_fla_bindings.py last with
#   fla-core's wheel from .fla/ on PYTHONPATH for that run only, under a timeout that dumps the
#   stacks (faulthandler); BENCH_FLA: "1" runs the benches with fla-core on PYTHONPATH too (its
#   chunked KDA / Gated DeltaNet for prefill); SPEC: "family:k ..." drafting benches (method mtp
#   with k tokens, the bench config's head on random weights: the cost side and the break-even
#   acceptance; SPEC_BATCHES, default 1,8; SPEC_FLAGS more flags); empty skips a part.
# Wheels for packages the machine lacks (transformers 5.23, pydantic; for AGENTIC the H100 image
# also lacks openai, fastapi and uvicorn: `pip download openai fastapi uvicorn` with their
# dependencies, the ones already in .whl/ left out) travel in .whl/.
set -uo pipefail
export PYTHONUNBUFFERED=1
# NVLink multicast stays off (the device's KINDS.md: it can take the host's GPUs out of service)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
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
# families transformers lacks keep their parity reference with the tests (pytest's pythonpath)
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD/tests"
TMP=$(mktemp -d)
# medium random checkpoints: hidden 1024, a few layers, real head shapes scaled down
declare -A MEDIUM=(
  [llama]='{"hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 8, "num_attention_heads": 16,
   "num_key_value_heads": 4, "vocab_size": 4096}'
  [beam]='{"hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 8, "num_attention_heads": 16,
   "num_key_value_heads": 4, "head_dim": 64, "moe_intermediate_size": 512, "num_experts": 32,
   "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2, "sliding_window": 64, "vocab_size": 4096}'
  [glm53]='{"hidden_size": 1024, "intermediate_size": 2048, "moe_intermediate_size": 512, "num_hidden_layers": 6,
   "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": 384, "kv_lora_rank": 256,
   "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64, "n_routed_experts": 32,
   "num_experts_per_tok": 4, "first_k_dense_replace": 1, "index_topk": 128, "index_head_dim": 64,
   "index_n_heads": 8, "index_topk_pattern": "FFSFFS", "vocab_size": 4096}'
  [glm53_flash]='{"text_config": {"hidden_size": 1024, "intermediate_size": 2048, "moe_intermediate_size": 512,
   "num_hidden_layers": 8, "layer_types": null, "indexer_types": null, "mlp_layer_types": null,
   "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": 384, "kv_lora_rank": 256,
   "qk_nope_head_dim": 64, "v_head_dim": 64, "n_routed_experts": 32, "num_experts_per_tok": 4,
   "index_topk": 128, "index_head_dim": 64, "index_n_heads": 8, "linear_num_heads": 8, "linear_head_dim": 64,
   "vocab_size": 4096}}'
  [qwen38]='{"hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2,
   "head_dim": 128, "linear_num_key_heads": 8, "linear_num_value_heads": 16, "linear_key_head_dim": 64,
   "linear_value_head_dim": 64, "moe_intermediate_size": 256, "shared_expert_intermediate_size": 512,
   "num_experts": 32, "num_experts_per_tok": 4, "vocab_size": 4096, "max_position_embeddings": 4096}'
  [qwen38_flash_next]='{"hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2,
   "head_dim": 128, "linear_num_key_heads": 8, "linear_num_value_heads": 16, "linear_key_head_dim": 64,
   "linear_value_head_dim": 64, "moe_intermediate_size": 256, "shared_expert_intermediate_size": 512,
   "num_experts": 32, "num_experts_per_tok": 4, "vocab_size": 4096, "max_position_embeddings": 4096,
   "ple_layer_ids": [1, 3, 5], "ple_embed_dim": 128, "indexer_n_heads": 4, "indexer_head_dim": 64,
   "indexer_budget": 4096, "indexer_compress_ratio": 16}'
  [kimi_k3]='{"text_config": {"vocab_size": 4096, "hidden_size": 1024, "intermediate_size": 2048,
   "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": 384,
   "kv_lora_rank": 256, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64, "num_experts": 32,
   "num_experts_per_token": 4, "moe_intermediate_size": 512, "routed_expert_hidden_size": 512,
   "attn_res_block_size": 2, "linear_attn_config": {"kda_layers": [1, 2, 3, 5, 6, 7], "full_attn_layers": [4, 8],
   "num_heads": 8, "head_dim": 64, "short_conv_kernel_size": 4, "use_full_rank_gate": true, "gate_lower_bound": -5.0}}}'
)
# each parity or bench command under a time limit, so that one hang leaves the call's other parts:
# SIGABRT first (faulthandler prints the stacks), SIGKILL 20 s later if that did not end it (a test
# stuck on the GPU on 2026-12-05 outlived its SIGABRT and the call's whole limit); no core files
# (a CUDA process's core dump writes its whole address space)
ulimit -c 0
T="timeout -k 20 -s ABRT ${PART_TIMEOUT:-300}"
for t in ${TESTS-}; do
  echo "[${SECONDS}s] == pytest $t"
  # -v: each test's name is in the log before it runs (a hang names itself); a test still running
  # after TEST_STACKS_S seconds has every thread's stack dumped (faulthandler) and goes on
  $T python3 -m pytest -v -rfE --tb=short -p no:cacheprovider -o faulthandler_timeout="${TEST_STACKS_S:-120}" \
    $t >>"$OUT/tests.log" 2>&1
  grep -E "FAILED|ERROR|passed|failed|Timeout|Fatal" "$OUT/tests.log" | tail -25
done
# the checkpoint on N GPUs (TP, and EP when asked) against one, fp32 (parity's own checks first)
ranks() {
  [ "$2" = float32 ] || return 0
  for n in ${TP-}; do
    for ep in "" ${EP:+--enable-expert-parallel} ${DP:+--enable-dp-attention}; do
      echo "[${SECONDS}s] == parity $1 on $n GPUs ${ep:-(tensor parallel)}"
      $T $DZ parity --checkpoint "$1" --seed 3 --device cuda --dtype float32 --tensor-parallel-size "$n" $ep 2>&1 \
        | grep "tensor parallel\|error\|Error" | tee -a "$OUT/parity.log"
    done
  done
}
for which in ${QPARITY-}; do
  dir=${which%:*}; dtype=${which#*:}; [ "$dtype" = bf16 ] && dtype=bfloat16 || dtype=float32
  echo "[${SECONDS}s] == parity $dir $dtype"
  $T $DZ parity --checkpoint "$dir" --seed 3 --device cuda --dtype $dtype 2>&1 \
    | grep -v "Loading weights\|falling back" | tee -a "$OUT/parity.log"
  ranks "$dir" $dtype
done
PARITY=${PARITY-"glm53:fp32 glm53:bf16 glm53_flash:fp32 glm53_flash:bf16"}
for which in $PARITY; do
  fam=${which%:*}; dtype=${which#*:}; [ "$dtype" = bf16 ] && dtype=bfloat16 || dtype=float32
  [ -d "$TMP/$fam" ] || $DZ tiny "$fam" "$TMP/$fam" --seed 3 --set "${MEDIUM[$fam]}" >/dev/null
  echo "[${SECONDS}s] == parity $fam medium $dtype"
  $T $DZ parity --checkpoint "$TMP/$fam" --seed 3 --device cuda --dtype $dtype 2>&1 \
    | grep -v "Loading weights\|falling back" | tee -a "$OUT/parity.log"
  ranks "$TMP/$fam" $dtype
done
# fla-core's wheel from .fla/, unpacked once into /tmp/fla (put on PYTHONPATH where a part asks for it)
fla() { [ -d /tmp/fla ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fla .fla/*.whl; }
BENCH_PATH=$PYTHONPATH
if [ -n "${BENCH_FLA-}" ] && [ -d .fla ]; then  # the bench with fla-core's kernels (KDA / Gated DeltaNet)
  fla && BENCH_PATH="$PYTHONPATH:/tmp/fla"
fi
for fam in ${BENCH-glm53_flash}; do
  for q in ${QUANT:-bf16}; do
   for run in $(seq "${REPEAT:-1}"); do
    echo "[${SECONDS}s] == bench decode $fam $q (run $run)"
    PYTHONPATH=$BENCH_PATH PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
      $T $DZ bench decode --family "$fam" --batches ${BATCHES:-1,8,32} --prompt-len 512 --new-tokens 64 \
      $([ "$q" = bf16 ] || echo --quantization "$q") ${BENCH_FLAGS-} 2>&1 \
      | tr "\r" "\n" | grep -v "loading weights\|falling back\|^$" | tee -a "$OUT/bench.log"
   done
  done
done
for fam in ${TP_BENCH_FAMILIES-}; do  # `bench decode` on N GPUs (TP_BENCH: "2 4 8"), random weights
  for n in ${TP_BENCH:-2}; do
    echo "[${SECONDS}s] == bench decode $fam on $n GPUs"
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True $T $DZ bench decode --family "$fam" \
      --tensor-parallel-size "$n" --batches ${BATCHES:-1,8,32} --prompt-len 512 --new-tokens 64 \
      --tokenizer "${TOKENIZER:-.tok}" ${BENCH_FLAGS-} 2>&1 | tr "\r" "\n" | grep -v "loading weights\|^$" \
      | tee -a "$OUT/bench_tp.log"
  done
done
for which in ${SPEC-}; do
  fam=${which%:*}; k=${which#*:}
  echo "[${SECONDS}s] == bench decode $fam drafting $k tokens"
  PYTHONPATH=$BENCH_PATH PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
    $T $DZ bench decode --family "$fam" --batches ${SPEC_BATCHES:-1,8} --prompt-len 512 --new-tokens 64 \
    --no-reference --prefill-len 0 --speculative-config "{\"method\": \"mtp\", \"num_speculative_tokens\": $k}" \
    ${SPEC_FLAGS-} 2>&1 | tr "\r" "\n" | grep -v "loading weights\|falling back\|^$" | tee -a "$OUT/spec.log"
done
for run in $(seq "${AGENTIC:-0}"); do
  echo "[${SECONDS}s] == bench agentic beam (run $run)"
  $T $DZ bench agentic --random-weights --family beam --agents 1 --dtype bfloat16 --tokenizer "${TOKENIZER:-.tok}" \
    --serve-flags "--max-num-batched-tokens 8192" 2>&1 | grep -v "^$" | tee -a "$OUT/agentic.log" | tail -4
done
if [ -n "${FLA-}" ] && [ -d .fla ]; then
  echo "[${SECONDS}s] == pytest tests/test_fla_bindings.py (fla-core)"
  fla
  PYTHONPATH=/tmp/site:/tmp/fla timeout -k 20 -s ABRT "${FLA_TIMEOUT:-300}" python3 -X faulthandler -m pytest -q -x \
    -p no:cacheprovider tests/test_fla_bindings.py >>"$OUT/fla.log" 2>&1; tail -40 "$OUT/fla.log"
fi
