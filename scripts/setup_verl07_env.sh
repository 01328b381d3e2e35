#!/usr/bin/env bash
# Creates or reuses .venv-verl07 (VENV_VERL07 overrides the path): the environment of the verl 0.7.1 legacy-actor
# tests. verl 0.7.1 pins numpy<2, so it gets its own environment. Usage: bash scripts/setup_verl07_env.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/new_torch_venv.sh
source scripts/uv_install.sh
VENV="${VENV_VERL07:-.venv-verl07}"
PY="$VENV/bin/python"
# What the legacy actor path needs on CPU, and nothing else (verl is installed without its dependencies: its full
# list pulls wandb, vllm-era extras and a CUDA torch). transformers is the version the main environment tests.
# TRANSFORMERS_VERL07 picks another transformers release (with its own VENV_VERL07).
# TRANSFORMERS_VERL07=4.57.3 passes too.
# peft: verl's LoRA (model.lora_rank > 0) wraps the actor in a PeftModel.
DEPS=("numpy<2" "tensordict>=0.8.0,<=0.10.0,!=0.9.0" "transformers==${TRANSFORMERS_VERL07:-5.10.4}" "ray>=2.41.0"
      "hydra-core" "codetiming" "einops" "packaging" "peft" "pytest")
# the stamp names the dependency list: an environment built for another list is completed on the next run
STAMP="$VENV/.zorro-verl07-ready-$(printf '%s\n' "${DEPS[@]}" | md5sum | cut -c1-8)"

if [[ ! -f "$STAMP" ]]; then
  start=$(date +%s)
  [[ -x "$PY" ]] || new_torch_venv "$VENV" "${MAIN_VENV:-.venv}"  # torch first: nothing below may pull a CUDA build
  # through uv, compiled at install (scripts/uv_install.sh)
  uv_install "$VENV" --no-deps verl==0.7.1
  constraints="$(mktemp)"
  printf 'torch==2.13.0\nnumpy<2\n' > "$constraints"
  uv_install "$VENV" -c "$constraints" "${DEPS[@]}"
  rm -f "$constraints"
  uv_install "$VENV" --no-deps -e .
  "$PY" - <<'PY'
import importlib.metadata as md
import numpy, torch, transformers, verl.workers.actor.dp_actor  # noqa: F401  the actor path imports
assert md.version("verl") == "0.7.1" and numpy.__version__.startswith("1."), (md.version("verl"), numpy.__version__)
print(f"verl {md.version('verl')}, torch {torch.__version__}, transformers {transformers.__version__}, numpy {numpy.__version__}")
PY
  touch "$STAMP"
  echo "built $VENV in $(( $(date +%s) - start )) s"
fi
