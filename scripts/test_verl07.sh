#!/usr/bin/env bash
# verl 0.7.1 legacy-actor tests in their own environment (.venv-verl07, built or reused by setup_verl07_env.sh:
# verl 0.7.1 pins numpy<2). Runs tests/integrations/verl/v07 on CPU (gloo, one process).
# Usage: bash scripts/test_verl07.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_verl07_env.sh
PY="${VENV_VERL07:-.venv-verl07}/bin/python"
exec "$PY" -m pytest tests/integrations/verl/v07 -q -p no:cacheprovider "$@"
