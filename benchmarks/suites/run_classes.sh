#!/usr/bin/env bash
# Each instruction-set class on this machine (VIASD_MAX_CPU_ISA caps viasd's kernels, ATen, oneDNN and
# MKL to it): float32 `ar` against transformers' generate(), the int4 `ar` against llama.cpp on the
# embedded model's GGUF file, and a 768-token prefill against transformers' forward. Every figure has
# its baseline from the same process. Resumable: a finished step's JSON is kept and skipped.
#   CLASSES="avx2 avx512 native" N=64 LIMIT=13 THREADS=2 bash benchmarks/suites/run_classes.sh [OUT_DIR]
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-out/classes}
N=${N:-64}; LIMIT=${LIMIT:-13}; THREADS=${THREADS:-2}
PROMPTS=${PROMPTS:-docs/results/cpu-prompts.jsonl}
mkdir -p "$OUT"
step() {  # step FILE COMMAND...: run COMMAND into FILE unless FILE is there (temporary file, then rename)
  local f=$1; shift
  [ -s "$f" ] && return 0
  if "$@" > "$f.tmp"; then mv "$f.tmp" "$f"; else echo "failed: $*" >&2; rm -f "$f.tmp"; fi
}
for cls in ${CLASSES:-avx2 avx512 native}; do
  export VIASD_MAX_CPU_ISA=$cls
  common=(--prompts "$PROMPTS" --limit "$LIMIT" -n "$N" --threads "$THREADS" --warmup 1 --json -q)
  step "$OUT/$cls-fp32-ar-hf.json" viasd bench --quant none --methods ar,hf "${common[@]}"
  step "$OUT/$cls-int4-ar-llamacpp.json" viasd bench --quant int4 --methods ar,llama.cpp "${common[@]}"
  step "$OUT/$cls-prefill.json" python3 benchmarks/suites/prefill.py --tokens 768 --formats none,int4 --threads "$THREADS" --repeats 3
done
