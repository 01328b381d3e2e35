#!/usr/bin/env bash
# GPU checks of zorro_verl on one CUDA GPU (made for an H200), offline, in under 8 minutes:
#   1. which flash / flex kernels exist here (flash-attn may be absent: PyTorch's built-in flash kernels are used);
#   2. the GPU tests (pytest -m gpu): flash gather, flash copy-free, flex and the hybrid (delta-net) models vs fp64
#      by the relative rule;
#   3. the GPU benchmark: bf16 Qwen3-0.6B-shaped model from config, scenarios (8,2,4096,512) and (16,1,8192,1024),
#      fwd and fwd_bwd, zorro flash / flash_copyfree / flex vs the ordinary forward (response-only head and full
#      logits), gradient checkpointing on.
# The table is printed last. Results go to $OUT (the device tool's folder) or ./bench-out.
# Needs only torch + transformers (+ pytest) on the machine; nothing is downloaded.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-bench-out}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
T0=$(date +%s)

echo "== environment"
"$PY" - <<'EOF' 2>&1 | tee "$OUT_DIR/gpu_env.txt"
import torch, transformers
from zorro_verl.attention.varlen import flash_provider
print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)
if not torch.cuda.is_available():
    raise SystemExit("no CUDA device: the GPU checks cannot run here")
print("device", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
try:
    import flash_attn
    print("flash-attn", flash_attn.__version__)
except ImportError:
    print("flash-attn: not installed")
print("flash provider for zorro backends 'flash' / 'flash_copyfree':", flash_provider())
try:
    import torch.nn.attention.flex_attention  # noqa: F401
    print("flex_attention: available")
except ImportError:
    print("flex_attention: missing")
EOF
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 1

BACKENDS=$("$PY" -c "
from zorro_verl.bench import available_backends
import torch
print(','.join(b for b in available_backends(torch.device('cuda')) if b != 'sdpa'))")
echo "backends that will run: $BACKENDS"

echo "== GPU tests"
timeout 170 "$PY" -m pytest -q -m gpu tests/test_gpu.py tests/test_hybrid.py -p no:cacheprovider -rs 2>&1 | tee "$OUT_DIR/gpu_tests.log"
TESTS_RC=${PIPESTATUS[0]}

echo "== GPU benchmark (bf16, qwen3-0.6b shape, backends $BACKENDS)"
timeout 280 "$PY" -m zorro_verl.bench --device cuda --model qwen3-0.6b --dtype bfloat16 \
    --scenario 8,2,4096,512 --scenario 16,1,8192,1024 --backends "$BACKENDS" --reps 5 --warmup 1 \
    --json "$OUT_DIR/gpu_bench.json" --plot "$OUT_DIR/gpu_bench.png" 2>&1 | tee "$OUT_DIR/gpu_bench.log"
BENCH_RC=${PIPESTATUS[0]}

echo
echo "== summary: tests rc=$TESTS_RC, bench rc=$BENCH_RC, $(( $(date +%s) - T0 )) s; backends: $BACKENDS"
if [ -f "$OUT_DIR/gpu_bench.json" ]; then
    "$PY" -c "
import json, sys
from zorro_verl.bench import format_table
print(format_table(json.load(open(sys.argv[1]))))" "$OUT_DIR/gpu_bench.json"
else
    echo "(no benchmark table: the benchmark did not finish)"
fi
[ "$TESTS_RC" -eq 0 ] && [ "$BENCH_RC" -eq 0 ]
