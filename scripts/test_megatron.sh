#!/usr/bin/env bash
# The Megatron integration tests in their own environment (.venv-megatron, built or reused by
# setup_megatron_env.sh: megatron-core 0.19.2 on the project's Python 3.11 needs --ignore-requires-python). Runs
# tests/integrations/megatron (zorro on megatron-core's GPTModel vs megatron's ordinary forward, fp64: TP = 1
# in-process, TP = 2 and TP = 2 + sequence parallelism in one 2-process gloo group; gated delta-net hybrids on CPU
# stand-ins for FLA and the TE-only hybrid block, tests/support/megatron_gdn.py) and verl's Megatron engine.
# ZORRO_MEGATRON_VENV=DIR runs them in an environment that already holds the same stack instead (checked by
# scripts/check_megatron_env.py, never installed into or rebuilt): scripts/test.sh passes .venv-e2e, which
# setup_e2e_env.sh builds with the Megatron packages of setup_megatron_env.sh for the Megatron main_ppo runs, so CI
# builds one environment for both.
# Usage: bash scripts/test_megatron.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -n "${ZORRO_MEGATRON_VENV:-}" ]]; then
  VENV="$ZORRO_MEGATRON_VENV"
  "$VENV/bin/python" scripts/check_megatron_env.py
else
  bash scripts/setup_megatron_env.sh
  VENV="${VENV_MEGATRON:-.venv-megatron}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export ZORRO_REQUIRE_MEGATRON_BRIDGE=1  # installed in either environment: its cases must run
exec "$VENV/bin/python" -m pytest tests/integrations/megatron -q -s -p no:cacheprovider "$@"
