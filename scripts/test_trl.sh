#!/usr/bin/env bash
# The TRL integration tests in their own environment (.venv-trl, built or reused by setup_trl_env.sh: trl 1.16 runs
# on transformers 5.15, which verl 0.9.1 does not admit). Runs tests/integrations/trl (zorro's GRPOTrainer vs stock
# TRL: the log-prob seam in fp64 / fp32, train() steps per loss type, LoRA, accumulation, num_iterations, refusals).
# Usage: bash scripts/test_trl.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_trl_env.sh
VENV="${VENV_TRL:-.venv-trl}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$VENV/bin/python" -m pytest tests/integrations/trl -q -s -p no:cacheprovider "$@"
