#!/usr/bin/env bash
# Every method on one model pair, in one process: ar, transformers (plain, assisted, prompt lookup),
# sd, exact and viasd (the last two need `viasd calibrate` first, else they are reported skipped).
#
#   benchmarks/suites/run_bench.sh                                  # embedded SmolLM2-135M, shipped prompts
#   MODEL=Qwen/Qwen2.5-7B-Instruct DRAFT=Qwen/Qwen2.5-0.5B-Instruct PROMPTS=spec_bench.jsonl LIMIT=80 \
#     benchmarks/suites/run_bench.sh
#
# Results go to out/bench/<name>/ (results.jsonl, summary.json, PNG plots); the name encodes the
# configuration. Extra arguments are passed to `viasd bench` (e.g. --methods ar,hf,sd --breakdown).
set -euo pipefail
cd "$(dirname "$0")/../.."

MODEL=${MODEL:-smollm2-135m}
DRAFT=${DRAFT:-auto}
GAMMA=${GAMMA:-5}
MAX_NEW=${MAX_NEW:-128}
WARMUP=${WARMUP:-1}
REPEATS=${REPEATS:-3}
LIMIT=${LIMIT:-}
PROMPTS=${PROMPTS:-}

slug() { echo "$1" | tr '/:' '__'; }
NAME=${NAME:-"$(slug "$MODEL")__$(slug "$DRAFT")__g${GAMMA}__n${MAX_NEW}__r${REPEATS}"}
OUT=${OUT:-out/bench/$NAME}   # out/ is git-ignored

args=(bench --model "$MODEL" --draft "$DRAFT" --gamma "$GAMMA" --max-new-tokens "$MAX_NEW"
      --warmup "$WARMUP" --repeats "$REPEATS" --out "$OUT" --breakdown)
[[ -n "$PROMPTS" ]] && args+=(--prompts "$PROMPTS")
[[ -n "$LIMIT" ]] && args+=(--limit "$LIMIT")

echo "viasd ${args[*]} $*" >&2
viasd "${args[@]}" "$@"
echo "results in $OUT" >&2
