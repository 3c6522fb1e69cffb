#!/usr/bin/env bash
# Set-up and the main job: multi-tier generation on the embedded default pair.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
viasd generate "${@:-Explain in three sentences why speculative decoding makes LLM inference faster.}"
