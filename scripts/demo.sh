#!/usr/bin/env bash
# The main job: ordinary vs ZoRRo forward+backward on a GRPO-shaped batch (CPU, Qwen3 built from a config).
# Extra arguments go to `zorro-verl demo` (e.g. --model PATH, -B 16 -G 2 -P 512 -R 64, --dtype float32).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
zorro-verl demo "$@"
