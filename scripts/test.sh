#!/usr/bin/env bash
# Set-up and the whole test suite (CPU, no network; the Triton kernels run in the interpreter).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
python3 -m pip install -q triton
# clang as well where apt-get can install it (about 7 s with apt-get update on the project's machines):
# tests/kernels/test_kernels_build.py builds every C kernel with it too; without it those tests skip.
if ! command -v clang >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  { apt-get update -qq && apt-get install -y -qq clang; } >/dev/null 2>&1 \
    || echo "viasd: clang could not be installed; the clang kernel builds are not tested" >&2
fi
# One worker a core (pytest-xdist), each test file whole in one worker (its module fixtures built once);
# the slowest tests listed at the end.
TRITON_INTERPRET=1 python3 -m pytest -q -n auto --dist loadfile --durations=25 "$@"
