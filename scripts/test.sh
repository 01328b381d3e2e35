#!/usr/bin/env bash
# The whole test suite on a fresh machine: set up .venv (see setup_env.sh), then run pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
start=$(date +%s)
python -m pytest -q -p no:cacheprovider tests "$@"
echo "[test] main suite took $(( $(date +%s) - start )) s"
