#!/usr/bin/env bash
# The OpenRLHF integration tests in their own environment (.venv-openrlhf, built or reused by
# setup_openrlhf_env.sh: openrlhf 0.11.2 pins transformers 5.15, which verl 0.9.1 does not admit). Runs
# tests/integrations/openrlhf (zorro's forward vs the real openrlhf Actor, the replay buffer / experience-maker
# batching, the switch reaching real Ray workers). Usage: bash scripts/test_openrlhf.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_openrlhf_env.sh
VENV="${VENV_OPENRLHF:-.venv-openrlhf}"
# the loader's files in site-packages are copies of this checkout's code (the env is reused across changes to it)
"$VENV/bin/python" -m zorro_verl.cli openrlhf install >/dev/null
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$VENV/bin/python" -m pytest tests/integrations/openrlhf -q -s -p no:cacheprovider "$@"
