#!/usr/bin/env bash
# Creates or reuses .venv-trl: the environment of the TRL tests (tests/integrations/trl), kept apart from .venv
# because trl 1.16 runs on transformers 5.15 (verl 0.9.1 needs <5.11).
#   torch 2.13.0 (CPU) first (scripts/new_torch_venv.sh: hard-linked from .venv when it holds the same build)
#   -> trl 1.16.0, transformers 5.15.x, peft, datasets, accelerate (torch and transformers held by a constraints file)
#   -> pytest, hypothesis
#   -> zorro_verl (editable, no deps: the verl extra stays out).
# Reinstalls only when this script or pyproject.toml changed (stamp in the venv). VENV_TRL overrides the path.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/new_torch_venv.sh
source scripts/uv_install.sh
VENV="${VENV_TRL:-.venv-trl}"
PY="$VENV/bin/python"
TRL="trl==1.16.0"
TRANSFORMERS="transformers==5.15.1"  # inside zorro's >=5.5.3,<5.16 and what trl 1.16 runs on
DEPS=("$TRL" "$TRANSFORMERS" "peft" "datasets" "accelerate" "pytest" "hypothesis")
[ -d /opt/wheels ] && export PIP_FIND_LINKS="${PIP_FIND_LINKS:-/opt/wheels}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

STAMP_SRC="$(cat pyproject.toml scripts/setup_trl_env.sh scripts/uv_install.sh | sha256sum | cut -d' ' -f1)"
if [ -x "$PY" ] && [ "$(cat "$VENV/.zorro-trl-stamp" 2>/dev/null || true)" = "$STAMP_SRC" ]; then
  echo "[setup-trl] $VENV up to date"
  exit 0
fi
start=$(date +%s)
rm -rf "$VENV"
new_torch_venv "$VENV" "${MAIN_VENV:-.venv}"  # torch first: nothing below may pull a CUDA build
constraints="$(mktemp)"
printf 'torch==2.13.0\n%s\n' "$TRANSFORMERS" > "$constraints"
uv_install "$VENV" -c "$constraints" "${DEPS[@]}"  # through uv, compiled at install (scripts/uv_install.sh)
rm -f "$constraints"
uv_install "$VENV" --no-deps -e .
"$PY" - <<'PY'
import importlib.metadata as md
import sys
import torch
want = {"trl": "1.16.", "transformers": "5.15.", "torch": "2.13.0"}
bad = [f"{k}: want {v}*, got {md.version(k)}" for k, v in want.items() if not md.version(k).startswith(v)]
if torch.version.cuda is not None:
    bad.append(f"torch is a CUDA build ({torch.__version__})")
if bad:
    sys.exit("[setup-trl] broken environment:\n  " + "\n  ".join(bad))
print("[setup-trl] ok:", ", ".join(f"{k} {md.version(k)}" for k in (*want, "peft", "accelerate", "datasets")))
PY
echo "$STAMP_SRC" > "$VENV/.zorro-trl-stamp"
echo "[setup-trl] built $VENV in $(( $(date +%s) - start )) s"
