#!/usr/bin/env bash
# The exactness table's runs: `ar` and `sd` greedy over the 26 held-out prompts, one bench run per
# instruction-set class and weight format, each in OUT/CLASS-FORMAT (a finished run is skipped, so
# the script resumes). Then: python benchmarks/exactness_table.py OUT/*/
#
#   bash benchmarks/exactness.sh OUT CLASS FORMAT...     CLASS: native, avx512_bf16, avx512 or avx2
#   bash benchmarks/exactness.sh out/exactness avx2 none int8 int4
set -euo pipefail
cd "$(dirname "$0")/.."
out=$1 cap=$2
shift 2
mkdir -p "$out"
for fmt in "$@"; do
  run="$out/$cap-$fmt"
  [ -f "$run/summary.json" ] && continue
  VIASD_MAX_CPU_ISA="$cap" viasd bench --methods ar,sd --prompts docs/results/cpu-prompts.jsonl -n 64 --warmup 0 \
    --repeats 1 --threads 2 --max-context 1024 --quant "$fmt" --out "$run" -q > "$run.log" 2>&1 \
    || echo "$cap $fmt failed: see $run.log" >&2
done
