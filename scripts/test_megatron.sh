#!/usr/bin/env bash
# The Megatron integration tests in their own environment (.venv-megatron, built or reused by
# setup_megatron_env.sh: megatron-core 0.19.2 on the project's Python 3.11 needs --ignore-requires-python). Runs
# tests/integrations/megatron (zorro on megatron-core's GPTModel vs megatron's ordinary forward, fp64: TP = 1
# in-process, TP = 2 and TP = 2 + sequence parallelism in one 2-process gloo group; gated delta-net hybrids on CPU
# stand-ins for FLA and the TE-only hybrid block, tests/support/megatron_gdn.py) and verl's Megatron engine.
# Usage: bash scripts/test_megatron.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_megatron_env.sh
VENV="${VENV_MEGATRON:-.venv-megatron}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export ZORRO_REQUIRE_MEGATRON_BRIDGE=1  # installed by setup_megatron_env.sh: its cases must run
exec "$VENV/bin/python" -m pytest tests/integrations/megatron -q -s -p no:cacheprovider "$@"
