#!/usr/bin/env bash
# Creates or reuses .venv-openrlhf: the environment of the OpenRLHF tests (tests/integrations/openrlhf), kept apart
# from .venv because openrlhf 0.11.2 pins transformers==5.15.0 (verl 0.9.1 needs <5.11) and flash-attn (which does
# not install on a CPU host).
#   torch 2.13.0 (CPU) first (scripts/new_torch_venv.sh: hard-linked from .venv when it holds the same build)
#   -> openrlhf 0.11.2 without its dependencies
#   -> what the actor / replay-buffer path imports: transformers 5.15.0, peft, einops, numpy, sympy, pylatexenc
#   -> wrapt (zorro's post-import hooks), ray 2.55.0 (the loader test runs real Ray workers), pytest, aiohttp and
#      pillow (openrlhf.trainer.ray imports them)
#   -> deepspeed 0.19.6 (OpenRLHF's pin; its Python only, DS_BUILD_OPS=0: no C++ op is compiled, the tests run
#      the engine on its CPU accelerator without any, see tests/support/openrlhf_deepspeed.py) and what OpenRLHF's
#      DeepspeedStrategy imports (torchdata, accelerate)
#   -> zorro_verl (editable, no deps) and its OpenRLHF loader (zorro-verl openrlhf install: a .pth file).
# flash_attn stays absent: the tests put tests/support/openrlhf_stubs on the path (pure-torch stand-ins for the
# helpers OpenRLHF's modules import at import time; see its README). Reinstalls only when this script or
# pyproject.toml changed (stamp in the venv). VENV_OPENRLHF overrides the path.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/new_torch_venv.sh
source scripts/uv_install.sh
VENV="${VENV_OPENRLHF:-.venv-openrlhf}"
PY="$VENV/bin/python"
OPENRLHF="openrlhf==0.11.2"
TRANSFORMERS="transformers==5.15.0"
RAY="ray==2.55.0"  # OpenRLHF's pin; the loader test starts real Ray workers
DEEPSPEED="deepspeed==0.19.6"  # OpenRLHF's pin; the engine tests run it on its CPU accelerator (gloo)
DEPS=("$TRANSFORMERS" "peft" "einops" "numpy" "sympy" "pylatexenc" "packaging" "wrapt" "$RAY" "pytest" "hypothesis"
      "aiohttp" "pillow")  # the last two: openrlhf.trainer.ray imports them (the Ray loader test)
[ -d /opt/wheels ] && export PIP_FIND_LINKS="${PIP_FIND_LINKS:-/opt/wheels}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

STAMP_SRC="$(cat pyproject.toml scripts/setup_openrlhf_env.sh scripts/uv_install.sh | sha256sum | cut -d' ' -f1)"
if [ -x "$PY" ] && [ "$(cat "$VENV/.zorro-openrlhf-stamp" 2>/dev/null || true)" = "$STAMP_SRC" ]; then
  echo "[setup-openrlhf] $VENV up to date"
  exit 0
fi
start=$(date +%s)
rm -rf "$VENV"
new_torch_venv "$VENV" "${MAIN_VENV:-.venv}"  # torch first: nothing below may pull a CUDA build
# through uv, compiled at install (scripts/uv_install.sh)
uv_install "$VENV" --no-deps "$OPENRLHF"
constraints="$(mktemp)"
printf 'torch==2.13.0\n%s\n' "$TRANSFORMERS" > "$constraints"
uv_install "$VENV" -c "$constraints" "${DEPS[@]}"  # openrlhf: --no-deps
# an sdist: DS_BUILD_OPS=0 builds no op (DeepSpeed would JIT-compile one on first use), DS_ACCELERATOR=cpu
DS_BUILD_OPS=0 DS_ACCELERATOR=cpu uv_install "$VENV" -c "$constraints" "$DEEPSPEED" torchdata accelerate
rm -f "$constraints"
uv_install "$VENV" --no-deps -e .
"$PY" -m zorro_verl.cli openrlhf install
"$PY" - <<'PY'
import importlib.metadata as md
import sys
import torch
want = {"openrlhf": "0.11.2", "transformers": "5.15.0", "torch": "2.13.0", "ray": "2.55.0", "deepspeed": "0.19.6"}
bad = [f"{k}: want {v}, got {md.version(k)}" for k, v in want.items() if not md.version(k).startswith(v)]
if torch.version.cuda is not None:
    bad.append(f"torch is a CUDA build ({torch.__version__})")
try:  # the tests' stand-in must never shadow a real install
    md.version("flash-attn")
    bad.append("flash_attn is installed; the tests expect it absent (stand-in in tests/support/openrlhf_stubs)")
except md.PackageNotFoundError:
    pass
if bad:
    sys.exit("[setup-openrlhf] broken environment:\n  " + "\n  ".join(bad))
print("[setup-openrlhf] ok:", ", ".join(f"{k} {md.version(k)}" for k in want))
PY
echo "$STAMP_SRC" > "$VENV/.zorro-openrlhf-stamp"
echo "[setup-openrlhf] built $VENV in $(( $(date +%s) - start )) s"
