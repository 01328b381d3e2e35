#!/usr/bin/env bash
# The user's path from the package alone: build zorro-verl's wheel, install it with its `verl` extra into an
# environment of its own (.venv-wheel; WHEEL_VENV overrides the path), then, from an empty folder (no checkout on
# the path): import the package and the plugin as verl does, compose the shipped preset through verl's own
# main_ppo (`--config-path=pkg://zorro_verl.configs`), validate it into zorro's engine config, and print
# `zorro-verl doctor`. The environment is reused; the wheel is rebuilt and reinstalled on every run.
# Usage: bash scripts/test_wheel.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
source scripts/new_torch_venv.sh
VENV="${WHEEL_VENV:-$ROOT/.venv-wheel}"
PY="$VENV/bin/python"
[ -d /opt/wheels ] && export PIP_FIND_LINKS="${PIP_FIND_LINKS:-/opt/wheels}"
export PIP_DISABLE_PIP_VERSION_CHECK=1
start=$(date +%s)

DIST="$(mktemp -d)"
trap 'rm -rf "$DIST"' EXIT
echo "[wheel] building the wheel"
"$ROOT/.venv/bin/python" -m pip wheel -q --no-deps --no-build-isolation -w "$DIST" "$ROOT"
WHEEL="$(ls "$DIST"/zorro_verl-*.whl)"
"$ROOT/.venv/bin/python" -c 'import sys, zipfile; names = zipfile.ZipFile(sys.argv[1]).namelist(); sys.exit(any(
f"zorro_verl/configs/{n}.yaml" not in names for n in ("zorro_ppo_trainer", "zorro_megatron_trainer")))' "$WHEEL" \
  || { echo "[wheel] FAIL: the wheel does not carry the presets (zorro_verl/configs/*.yaml)"; exit 1; }

if [[ ! -x "$PY" ]]; then
  echo "[wheel] creating $VENV"
  new_torch_venv "$VENV" "$ROOT/.venv"  # torch first: nothing below may pull a CUDA build
fi
echo "[wheel] installing $(basename "$WHEEL")[verl]"
"$PY" -m pip install -q --no-compile --force-reinstall --no-deps "$WHEEL"
"$PY" -m pip install -q --no-compile "${WHEEL}[verl]" "torch==2.13.0"

WORK="$(mktemp -d)"
trap 'rm -rf "$DIST" "$WORK"' EXIT
cd "$WORK"
echo "[wheel] checks from $WORK (no checkout on the path)"
"$PY" - "$VENV" <<'PY'
import os, sys
venv = os.path.realpath(sys.argv[1])
import zorro_verl
assert os.path.realpath(zorro_verl.__file__).startswith(venv), f"zorro_verl imported from {zorro_verl.__file__}"
import verl  # loads the verl.plugins entry points, as in every verl process
from zorro_verl.integrations.verl.v09 import registration
assert registration.is_installed(), "import verl did not load the zorro plugin from the wheel"
from hydra import compose, initialize_config_module
from verl.utils.config import omega_conf_to_dataclass
from zorro_verl.integrations.verl.settings import settings_of
from zorro_verl.integrations.verl.v09.config import ZorroFSDPEngineConfig
with initialize_config_module(config_module="zorro_verl.configs", version_base=None):
    cfg = compose(config_name="zorro_ppo_trainer", overrides=["actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "data.train_batch_size=8"])
actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)  # validates and checks the engine registration
assert isinstance(actor.engine, ZorroFSDPEngineConfig) and settings_of(actor.engine).enable
assert settings_of(actor.engine).rollout_n == 4
# what verl's default (V1) main_ppo imports when it runs: the `verl` extra must have brought it
import transfer_queue  # noqa: F401
import verl.trainer.ppo.v1.trainer_base  # noqa: F401
print(f"[wheel] ok: zorro_verl {zorro_verl.__version__} from the wheel; plugin loaded by import verl; preset "
      "composed from the package and validated; the V1 trainer and TransferQueue import")
PY
"$PY" -m verl.trainer.main_ppo --config-path=pkg://zorro_verl.configs --config-name=zorro_ppo_trainer --cfg job \
  > main_ppo_cfg.txt
grep -q "_target_: zorro_verl.integrations.verl.v09.config.ZorroFSDPEngineConfig" main_ppo_cfg.txt \
  || { echo "[wheel] FAIL: main_ppo did not compose the preset from the package"; exit 1; }
echo "[wheel] ok: python -m verl.trainer.main_ppo --config-path=pkg://zorro_verl.configs composes the preset"
"$VENV/bin/zorro-verl" doctor
echo "[wheel] passed in $(( $(date +%s) - start )) s"
