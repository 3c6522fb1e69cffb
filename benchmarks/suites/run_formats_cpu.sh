#!/usr/bin/env bash
# ar and sd on the embedded pair with the target in fp32, int8 and int4 (weight-only), one
# `viasd bench` process per format; the fp32 run also times transformers' generate() (hf), the
# baseline every format is compared with, and the int4 run llama.cpp on the same model's GGUF
# (skipped with a reason where llama-cpp-python is not installed).
# Resumable: a format whose summary exists is skipped.
#   bash benchmarks/suites/run_formats_cpu.sh [OUT_DIR] [PROMPTS_JSONL] [MAX_NEW]
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-out/formats}
PROMPTS=${2:-docs/results/cpu-prompts.jsonl}
NEW=${3:-128}
mkdir -p "$OUT"
for q in none int8 int4; do
  [ -f "$OUT/$q/summary.json" ] && continue
  methods=ar,sd
  [ "$q" = none ] && methods=ar,hf,sd
  [ "$q" = int4 ] && methods=ar,sd,llama.cpp
  viasd bench --quant "$q" --methods "$methods" --prompts "$PROMPTS" -n "$NEW" --max-context 1024 \
    --out "$OUT/$q" -q > "$OUT/$q.log" 2>&1 || echo "bench $q failed: see $OUT/$q.log"
done
echo "done: $OUT"
