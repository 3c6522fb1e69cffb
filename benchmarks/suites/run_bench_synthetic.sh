#!/usr/bin/env bash
# PROJECTIONS (not measurements) for full-size shapes: per-step costs measured on random-weight models
# of the real sizes, speedups of sd / exact / viasd projected from the acceptance of a real run.
# Needs a GPU for the full-size shapes (an 8B model in fp32 needs ~32 GB of RAM on CPU).
#
#   ACCEPTANCE=out/bench/<real run>/summary.json benchmarks/suites/run_bench_synthetic.sh
#   SHAPES="tiny" benchmarks/suites/run_bench_synthetic.sh        # a quick check on any machine
set -euo pipefail
cd "$(dirname "$0")/../.."

SHAPES=${SHAPES:-"llama-3-8b qwen2.5-7b vicuna-7b"}
GAMMA=${GAMMA:-5}
ACCEPTANCE=${ACCEPTANCE:-}

for shape in $SHAPES; do
  out="out/bench/projection__${shape}__g${GAMMA}"
  args=(bench --synthetic "$shape" --gamma "$GAMMA" --out "$out")
  [[ -n "$ACCEPTANCE" ]] && args+=(--acceptance-from "$ACCEPTANCE")
  echo "viasd ${args[*]} $*" >&2
  viasd "${args[@]}" "$@"
done
