#!/usr/bin/env bash
# Set-up and the whole test suite (CPU, no network; the Triton kernels run in the interpreter).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
python3 -m pip install -q triton
TRITON_INTERPRET=1 python3 -m pytest -q "$@"
