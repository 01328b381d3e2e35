# Source me: creates or reuses .venv and installs zorro_verl with its test and verl dependencies.
# torch is installed first, pinned to the CPU wheel on this machine's disk (a later unpinned resolve would pull
# a multi-GB CUDA build). Re-installs only when the dependency files changed (stamp in .venv).
# ZORRO_SETUP_TORCH_ONLY=1: only that first step (.venv with torch, what scripts/new_torch_venv.sh hard-links into
# the other environments, so scripts/test.sh starts building them while the rest of .venv installs).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for c in python3.11 python3.12 python3.10 python3; do command -v "$c" >/dev/null 2>&1 && { PY="$c"; break; }; done
fi
[ -d /opt/wheels ] && export PIP_FIND_LINKS="${PIP_FIND_LINKS:-/opt/wheels}"
export PIP_DISABLE_PIP_VERSION_CHECK=1
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $PY"
  "$PY" -m venv .venv
fi
STAMP_SRC="$(cat pyproject.toml scripts/setup_env.sh scripts/uv_install.sh | sha256sum | cut -d' ' -f1)"
if [ "$(cat .venv/.zorro-stamp 2>/dev/null || true)" != "$STAMP_SRC" ]; then
  if [[ "${ZORRO_SETUP_TORCH_ONLY:-}" == 1 ]]; then
    echo "[setup] installing torch==2.13.0 (CPU) into .venv"
    .venv/bin/python -m pip install -q "torch==2.13.0"
    return 0 2>/dev/null || exit 0  # sourced or run
  fi
  echo "[setup] installing torch==2.13.0 (CPU) first, then zorro_verl[dev,verl] (verl 0.9.1)"
  .venv/bin/python -m pip install -q "torch==2.13.0"
  source scripts/uv_install.sh  # through uv, compiled at install (see there)
  uv_install .venv -e ".[dev,verl]" "torch==2.13.0"
  echo "$STAMP_SRC" > .venv/.zorro-stamp
else
  echo "[setup] .venv up to date"
fi
export PATH="$ROOT/.venv/bin:$PATH"
