#!/usr/bin/env bash
# ar, sd and viasd with the target in none / 8bit / 4bit (bitsandbytes), each with its own ar
# baseline at the same quantization, in one process per quantization.
#   bash benchmarks/suites/run_quant_cpu.sh [OUT_DIR] [PROMPTS_JSONL] [LIMIT] [MAX_NEW]
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-out/quant}
PROMPTS=${2:-out/cpu/prompts.jsonl}
LIMIT=${3:-6}
NEW=${4:-64}
mkdir -p "$OUT"
for q in none 8bit 4bit; do
  viasd calibrate --quant "$q" --limit 6 -n 32 --budget 0.01 --out "$OUT/profile-$q.json" --json \
    > "$OUT/calibrate-$q.json" 2> "$OUT/calibrate-$q.log" || echo "calibrate $q: see $OUT/calibrate-$q.log"
  viasd bench --quant "$q" --methods ar,sd,viasd --profile "$OUT/profile-$q.json" --prompts "$PROMPTS" --limit "$LIMIT" \
    -n "$NEW" --out "$OUT/bench-$q" --json -q > /dev/null || echo "bench $q failed"
done
echo "done: $OUT"
