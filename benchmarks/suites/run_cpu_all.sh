#!/usr/bin/env bash
# The CPU measurements recorded in docs/experiments/ (records 1-3): calibration at three budgets, then the
# bench runs. Each bench run measures its own `ar` baseline in the same process.
#   bash benchmarks/suites/run_cpu_all.sh [OUT_DIR] [PER_CATEGORY] [MAX_NEW]
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-out/cpu}
PER=${2:-2}
NEW=${3:-128}
mkdir -p "$OUT"
DEV=benchmarks/data/spec_bench_dev.jsonl
# A stratified subset of the Spec-Bench dev prompts: the first PER of every category.
python3 - "$DEV" "$PER" > "$OUT/prompts.jsonl" <<'PY'
import json, sys
per, seen = int(sys.argv[2]), {}
for line in open(sys.argv[1]):
    row = json.loads(line)
    if seen.get(row["category"], 0) < per:
        seen[row["category"]] = seen.get(row["category"], 0) + 1
        print(line.strip())
PY
for b in 0.005 0.01 0.03; do
  viasd calibrate --budget "$b" --out "$OUT/profile-$b.json" --json > "$OUT/calibrate-$b.json" 2> "$OUT/calibrate-$b.log" \
    || echo "calibrate $b failed: see $OUT/calibrate-$b.log"
done
# 1. the distilled draft alone vs transformers (plain, assisted with the same draft, prompt lookup)
viasd bench --draft embedded:smollm2-135m-draft --methods ar,hf,hf-assisted,hf-pld,sd --prompts "$OUT/prompts.jsonl" \
  -n "$NEW" --out "$OUT/bench-draft" --json -q > /dev/null
# 2. prompt lookup (ngram) as the draft
viasd bench --draft ngram --methods ar,sd --prompts "$OUT/prompts.jsonl" -n "$NEW" --out "$OUT/bench-ngram" --json -q > /dev/null
# 3. the default draft (distilled + lookup) with the multi-tier modes at three budgets
PROFILES=$(ls "$OUT"/profile-*.json 2>/dev/null | paste -sd, -)
viasd bench --methods ar,hf,sd,exact --profile "$OUT/profile-0.01.json" --viasd-profiles "$PROFILES" \
  --prompts "$OUT/prompts.jsonl" -n "$NEW" --out "$OUT/bench-default" --json -q > /dev/null
echo "done: $OUT"
