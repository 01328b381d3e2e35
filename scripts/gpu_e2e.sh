#!/usr/bin/env bash
# GPU sibling of tests/e2e (not run on the CPU machines; written for one CUDA GPU, offline): the zorro-vs-stock
# pair of verl 0.9.1 main_ppo GRPO runs with the real (CUDA) vLLM, FSDP2 in bf16, on one GPU.
#   assets built offline (tests/e2e/assets.py: BPE tokenizer, tiny Qwen3 in bf16, 4-prompt parquet, reward file)
#   -> stock (zorro.enable=false) and zorro (the preset), V1 trainer, 2 steps, rollout.n=4, ref + KL loss, entropy,
#      remove-padding and dynamic batch size on, per-request rollout seeds so both runs get the same rollouts
#   -> the same checks and tables as the CPU test (step-1 metrics within --rtol, default 1e-2 for bf16; dedup ratio
#      equal to the value from the batch's token counts; zorro engine line; no fallbacks; step-2 KL > 0).
#
# --bench [qwen3-0.6b|qwen3-1.7b] [bench options]: the e2e speed benchmark instead (tests/e2e/bench.py --gpu):
# stock vs zorro (sharing=prompt) vs zorro (sharing=prefix) on identical recorded rollouts, random weights with the
# model's real dimensions (vocabulary: the benchmark tokenizer's 512), bf16 compute, flash-attn varlen for stock,
# 16 prompts x 8 per step behind a ~2K-token shared instruction, responses <= 256; prints the same per-phase table
# as scripts/bench_e2e.sh and writes phases.svg (exit 1 when a target is missed).
# Needs a Python with torch (CUDA), vllm (a CUDA build verl 0.9.1 accepts), verl 0.9.1, TransferQueue 0.1.11,
# pandas/pyarrow, psutil and zorro_verl installed (PYTHON=... to choose it); nothing is downloaded.
# Logs and rollout dumps go to $OUT (the device tool's folder) or ./bench-out/gpu_e2e.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
WORK="${OUT:-bench-out}/gpu_e2e"
mkdir -p "$WORK"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
"$PY" - <<'PYEOF' || exit 1
import importlib.metadata as md, torch
if not torch.cuda.is_available():
    raise SystemExit("no CUDA device: scripts/gpu_e2e.sh needs one GPU")
for name in ("torch", "vllm", "verl", "TransferQueue", "transformers", "zorro-verl"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        raise SystemExit(f"{name} is not installed in {__import__('sys').executable}")
print("device", torch.cuda.get_device_name(0))
PYEOF
if [ "${1:-}" = "--bench" ]; then
  shift
  model="qwen3-0.6b"
  case "${1:-}" in qwen3-*) model="$1"; shift ;; esac
  timeout 3000 "$PY" -m tests.e2e.bench --gpu "$model" --out "$WORK/bench-$model" "$@"
  rc=$?
else
  timeout 2400 "$PY" -m tests.e2e.gpu_pair --work "$WORK" "$@"
  rc=$?
fi
echo "[gpu-e2e] exit $rc (logs in $WORK)"
exit $rc
