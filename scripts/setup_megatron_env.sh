#!/usr/bin/env bash
# Creates or reuses .venv-megatron: the environment of the Megatron tests (tests/integrations/megatron), kept apart
# from .venv because megatron-core 0.19.2 declares Requires-Python >=3.12 while the project's CPU torch is cp311.
#   torch 2.13.0 (CPU) first (scripts/new_torch_venv.sh: hard-linked from .venv when it holds the same build)
#   -> megatron-core 0.19.2 pinned exactly, alone, with --ignore-requires-python --no-deps: PyPI has its cp311 wheel
#      (nothing compiled); an unpinned resolve would pick 0.16.1, the newest release declaring 3.11, which has no
#      GPTModel.forward(output_processor=...); its runtime deps (torch, numpy, packaging>=24.2) come below
#   -> triton (megatron-core 0.19 imports it at `import megatron.core`, for MoE kernels never run here)
#   -> verl 0.9.1 (no extras: its `megatron` extra pins CUDA torch, Transformer Engine, apex, flash-attn),
#      mbridge 0.15.1 (verl's legacy vanilla bridge) and einops (mbridge imports it without declaring it)
#   -> megatron-bridge 0.6.2 (verl's default model builder, vanilla_mbridge=false) alone with --no-deps
#      --ignore-requires-python: it declares Python >=3.12 (its sources parse on 3.11) and, as dependencies, CUDA-only
#      packages (flashinfer, Transformer Engine's extra, nvidia-modelopt, ...) and an sdist that imports torch in its
#      build; of them the paths verl runs need only megatron-energon (imported by the bridge's training config),
#      installed next with its own dependencies. The import-time CPU stand-ins it needs are in
#      tests/support/megatron_bridge_cpu.py (never shipped).
#   -> zorro_verl (editable, no deps) and the test tools.
# Reinstalls only when this script or pyproject.toml changed (stamp in the venv). VENV_MEGATRON overrides the path.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/new_torch_venv.sh
VENV="${VENV_MEGATRON:-.venv-megatron}"
PY="$VENV/bin/python"
MCORE="megatron-core==0.19.2"
VERL="verl==0.9.1"
MBRIDGE="mbridge==0.15.1"
MEGATRON_BRIDGE="megatron-bridge==0.6.2"
ENERGON="megatron-energon==7.4.1"
TRANSFORMERS="transformers==5.10.4"  # what verl 0.9.1 resolves to in .venv (it needs <5.11)
TRITON="triton==3.9.0"
[ -d /opt/wheels ] && export PIP_FIND_LINKS="${PIP_FIND_LINKS:-/opt/wheels}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

STAMP_SRC="$(cat pyproject.toml scripts/setup_megatron_env.sh scripts/check_megatron_env.py scripts/new_torch_venv.sh | sha256sum | cut -d' ' -f1)"
if [ -x "$PY" ] && [ "$(cat "$VENV/.zorro-megatron-stamp" 2>/dev/null || true)" = "$STAMP_SRC" ]; then
  echo "[setup-megatron] $VENV up to date"
  exit 0
fi
start=$(date +%s)
rm -rf "$VENV"
echo "[setup-megatron] 1/5 torch 2.13.0 (CPU) first"
new_torch_venv "$VENV" "${MAIN_VENV:-.venv}"  # torch first: nothing below may pull a CUDA build
echo "[setup-megatron] 2/5 $MCORE (cp311 wheel, --ignore-requires-python, no deps)"
"$PY" -m pip install -q --no-compile --no-deps --ignore-requires-python "$MCORE"
constraints="$(mktemp)"
printf 'torch==2.13.0\n%s\n%s\n' "$TRANSFORMERS" "$MCORE" > "$constraints"
echo "[setup-megatron] 3/5 $VERL, $MBRIDGE, einops, $TRITON and the test tools"
"$PY" -m pip install -q --no-compile --no-warn-conflicts -c "$constraints" \
  "$VERL" "$MBRIDGE" einops "$TRITON" numpy "packaging>=24.2" "$TRANSFORMERS" wrapt pytest hypothesis
echo "[setup-megatron] 4/5 $MEGATRON_BRIDGE (no deps, --ignore-requires-python), then $ENERGON"
"$PY" -m pip install -q --no-compile --no-deps --ignore-requires-python "$MEGATRON_BRIDGE"
"$PY" -m pip install -q --no-compile --no-warn-conflicts -c "$constraints" "$ENERGON"
rm -f "$constraints"
echo "[setup-megatron] 5/5 zorro_verl (editable, no deps)"
"$PY" -m pip install -q --no-compile --no-warn-conflicts --no-deps -e .
"$PY" scripts/check_megatron_env.py
echo "$STAMP_SRC" > "$VENV/.zorro-megatron-stamp"
echo "[setup-megatron] built $VENV in $(( $(date +%s) - start )) s"
