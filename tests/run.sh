#!/usr/bin/env bash
# Every test of dayzero: lint, the layering contracts, the Python tests, the C++ unit and compile-fail
# tests, then the C++ tests again under AddressSanitizer + UndefinedBehaviorSanitizer.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
JOBS=${JOBS:-2}

echo "== lint"
"$PY" -m ruff check pkg sdk kernels models tests scripts
"$PY" -m ruff format --check pkg sdk kernels models tests scripts
clang-format --dry-run --Werror csrc/include/dayzero/*.h csrc/src/*.cc csrc/bindings/*.cc csrc/tests/*.cc csrc/tests/*.h

echo "== layers (import-linter: no cycle, no upward import; pyproject.toml [tool.importlinter])"
"$PY" -c "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())" --no-cache

echo "== generated files are current"
"$PY" -m dayzero.sdk.cli codegen --check

echo "== python tests (unit, kernels, loader, engine, CLI, and each family's generated parity test)"
# Two workers (pytest-xdist, a test file a worker: module fixtures are built once), each torch
# single-threaded: the tests' models are tiny, and two threads a process on a 2-core machine that
# also runs servers and gloo ranks spin against each other (tiny ops 5-40x slower, measured).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
"$PY" -m pytest -q --durations=25 -n "${TEST_WORKERS:-2}" --dist loadfile tests models  # exits 5 (a failure here) if nothing was collected

for mode in plain asan; do
  echo "== C++ tests ($mode)"
  dir=build/cpp-$mode
  sanitize=$([ "$mode" = asan ] && echo ON || echo OFF)
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Debug -DDZ_BUILD_PYTHON=OFF -DDZ_BUILD_TESTS=ON \
    -DDZ_SANITIZE="$sanitize" >/dev/null
  cmake --build "$dir" -j "$JOBS"
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    ctest --test-dir "$dir" --output-on-failure -j "$JOBS" --no-tests=error
done
echo "== all tests passed"
