#!/usr/bin/env bash
# The slim view over (layers x weight format) on the embedded pair with the target in fp32:
# `viasd calibrate` at budgets 0.005 / 0.01 / 0.03 (it measures every candidate view and keeps
# the best modeled speedup over sd), then ONE `viasd bench` run: ar (fp32), hf, sd, exact,
# viasd at each budget, and ar-slim (the chosen view decoding alone), fidelity against the fp32
# target for every row. `exact` and `ar-slim` use the profile named by EXACT_BUDGET (default 0.03).
# Resumable: a profile or a bench summary that exists is not made again.
#   bash benchmarks/suites/run_slim_views_cpu.sh [OUT_DIR] [PROMPTS_JSONL] [MAX_NEW]
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-out/slim-views}
PROMPTS=${2:-docs/results/cpu-prompts.jsonl}
NEW=${3:-128}
EXACT_BUDGET=${EXACT_BUDGET:-0.03}
mkdir -p "$OUT"
for b in 0.005 0.01 0.03; do
  [ -f "$OUT/profile-$b.json" ] && continue
  # --force: a profile that misses the budget on held-out prompts is kept, marked, and reported
  viasd calibrate --quant none --budget "$b" --out "$OUT/profile-$b.json" --force \
    > "$OUT/calibrate-$b.txt" 2> "$OUT/calibrate-$b.log" || echo "calibrate $b failed: see $OUT/calibrate-$b.log"
done
if [ ! -f "$OUT/bench/summary.json" ]; then
  viasd bench --quant none --methods ar,hf,sd,exact,ar-slim --profile "$OUT/profile-$EXACT_BUDGET.json" \
    --viasd-profiles "$OUT/profile-0.005.json,$OUT/profile-0.01.json,$OUT/profile-0.03.json" \
    --prompts "$PROMPTS" -n "$NEW" --max-context 1024 --out "$OUT/bench" -q > "$OUT/bench.log" 2>&1 \
    || echo "bench failed: see $OUT/bench.log"
fi
echo "done: $OUT"
