#!/usr/bin/env bash
# GPU checks of zorro_verl on one CUDA GPU (made for an H200), offline, in about 9 minutes (+ the long-context rows
# where 2+ GPUs are visible):
#   1. which backends and flash / flex kernels exist here (the registry's available_backends; flash-attn may be
#      absent: PyTorch's built-in flash kernels are used);
#   2. the GPU tests (pytest -m gpu): flash gather, flash copy-free, flex (also with sliding windows, sinks and
#      soft-capping, and tiny gpt-oss / Gemma 2 models), the hybrid (delta-net) models and, where mamba-ssm and
#      causal-conv1d are installed, Mamba2 / Bamba on their fused Mamba-2 scan vs fp64 by the relative rule;
#      zorro_step under Ulysses sequence parallelism (flash backend, bf16, NCCL): SP = 2 with two or more GPUs,
#      else SP = 1 on the one GPU (the exchange is then a copy: the shard / gather / backend path runs, the
#      cross-GPU all-to-all does not; the CPU suite checks SP = 2 and SP = 2 x DP = 2 over gloo); megatron-core's
#      GPTModel with Transformer Engine's spec and fused RoPE (zorro's per-token table) by the same rule (skipped
#      where megatron-core or Transformer Engine is not installed on the machine), a Qwen3.5-shaped hybrid on
#      megatron's real hybrid block spec (TE) with flash-linear-attention's gated delta rule (skipped without FLA),
#      Qwen2.5-VL through verl's Megatron engine on the bridge's TE spec, and zorro's context parallelism (dense
#      and varlen CP attention) vs stock CP (verl's THD zigzag, Transformer Engine's CP attention) at CP = 2 by
#      the same rule (needs 2 GPUs);
#   3. the op-level attention benchmark (--preset gpu --ops): each GPU backend's split attention vs the ordinary
#      per-row SDPA of the same batch, bf16, Qwen3-0.6B heads (16/8 of 128), fwd and fwd_bwd;
#   4. the model-level benchmark (--preset gpu): bf16 Qwen3-0.6B-shaped model from config, scenarios
#      (8,2,4096,512) and (16,1,8192,1024), fwd and fwd_bwd, zorro flash / flash_copyfree / flex vs the ordinary
#      forward (response-only head and full logits), gradient checkpointing on; the preset's target (efficiency
#      >= 0.85 on (8,2,4096,512)) is checked.
#   5. the prefix-tree benchmark (--tree): agentic batches, ordinary vs prompt sharing vs sharing=prefix, bf16,
#      the first GPU backend (the tree's backend paths on real kernels; the targets are the CPU run's).
#   6. attention memory (--memory --device cuda): stock flash path vs flash vs flash_copyfree at the same token
#      budget, bf16, real kernels: bytes kept for backward, median ms of forward + backward and the allocator peak
#      (torch.cuda.max_memory_allocated) of the step; the memory rule (flash_copyfree <= stock) is checked.
#   7. the long-context rows (--long --preset gpu): verl 0.9's FSDP engine under Ulysses SP = 2 (one rank per GPU,
#      NCCL), zorro vs stock at the same sharding on 16K prompts x 16 rollouts and 32K x 8 (responses 1-2K tokens),
#      Qwen3-0.6B-shaped, bf16, flash-attention 2 for stock, gradient checkpointing on both sides: step and log-prob
#      pass times, ideal, efficiency, tokens and all-to-all bytes per rank (counted = cost model is checked). Needs
#      2+ GPUs, verl 0.9 and flash-attn; skipped otherwise (the CPU run, --long, covers the row's bookkeeping);
#      and verl 0.9's Megatron engine at CP = 2 (--long-engine verl-megatron: stock = Transformer Engine's CP
#      attention, zorro = its varlen CP attention on the flash kernels; needs Megatron-Bridge and TE).
# The tables are printed last. Results go to $OUT (the device tool's folder) or ./bench-out.
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
"$PY" - <<'PYEOF' 2>&1 | tee "$OUT_DIR/gpu_env.txt"
import torch, transformers
print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)
if not torch.cuda.is_available():
    raise SystemExit("no CUDA device: the GPU checks cannot run here")
from zorro_verl.attention.primitives import flash_provider
from zorro_verl.attention.registry import available_backends, flash_available
dev = torch.device("cuda")
print("device", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
try:
    import flash_attn
    print("flash-attn", flash_attn.__version__)
except ImportError:
    print("flash-attn: not installed")
print("flash backends available:", flash_available(dev), "- provider:", flash_provider())
print("zorro backends available on cuda:", ", ".join(available_backends(dev)))
PYEOF
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 1

# The GPU backends (the reference ones, sdpa / eager / standard, are what the CPU runs cover).
BACKENDS=$("$PY" -c "
import torch
from zorro_verl.attention.registry import available_backends
print(','.join(b for b in available_backends(torch.device('cuda')) if b not in ('sdpa', 'eager', 'standard')))")
echo "backends that will run: $BACKENDS"

echo "== GPU tests"
timeout 180 "$PY" -m pytest -q -m gpu tests/attention/test_gpu.py tests/integrations/transformers/test_hybrid.py tests/integrations/transformers/test_ssm.py tests/integrations/megatron/test_gpu.py tests/integrations/megatron/test_gpu_engine.py tests/integrations/megatron/test_gpu_context_parallel.py -p no:cacheprovider -rs 2>&1 | tee "$OUT_DIR/gpu_tests.log"
TESTS_RC=${PIPESTATUS[0]}

NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$NGPU" -ge 2 ]; then SP_NOTE="SP = 2 over NCCL on 2 GPUs"; else SP_NOTE="SP = 1 on 1 GPU (note: SP > 1 needs 2+ GPUs; covered on CPU over gloo)"; fi
echo "== Ulysses sequence-parallel step: $SP_NOTE"
timeout 120 "$PY" -m pytest -q -s -m gpu tests/integrations/transformers/test_ulysses_step.py -p no:cacheprovider -rs 2>&1 | tee "$OUT_DIR/gpu_ulysses.log"
SP_RC=${PIPESTATUS[0]}
[ "$SP_RC" -eq 0 ] || TESTS_RC=$SP_RC

echo "== GPU attention-op benchmark (--preset gpu --ops, backends $BACKENDS,sdpa)"
timeout 70 "$PY" -m zorro_verl.bench --preset gpu --ops --backends "${BACKENDS:+$BACKENDS,}sdpa" \
    --json "$OUT_DIR/gpu_ops.json" 2>&1 | tee "$OUT_DIR/gpu_ops.log"
OPS_RC=${PIPESTATUS[0]}

echo "== GPU benchmark (--preset gpu: bf16, qwen3-0.6b shape, backends $BACKENDS)"
timeout 250 "$PY" -m zorro_verl.bench --preset gpu --backends "${BACKENDS:-sdpa}" --reps 5 --warmup 1 \
    --json "$OUT_DIR/gpu_bench.json" --plot "$OUT_DIR/gpu_bench.png" 2>&1 | tee "$OUT_DIR/gpu_bench.log"
BENCH_RC=${PIPESTATUS[0]}

TREE_BACKEND="${BACKENDS%%,*}"
echo "== GPU prefix-tree benchmark (--tree: bf16, quick shape, backend ${TREE_BACKEND:-sdpa})"
timeout 90 "$PY" -m zorro_verl.bench --tree --device cuda --dtype bfloat16 --clock wall \
    --backends "${TREE_BACKEND:-sdpa}" --json "$OUT_DIR/gpu_tree.json" 2>&1 | tee "$OUT_DIR/gpu_tree.log"
TREE_RC=${PIPESTATUS[0]}

echo "== GPU attention memory (--memory: stock vs flash vs flash_copyfree, same token budget, bf16)"
timeout 120 "$PY" - "$OUT_DIR/gpu_memory.json" <<'PYEOF' 2>&1 | tee "$OUT_DIR/gpu_memory.log"
import sys
import torch
from zorro_verl.bench.cli import main
if not torch.cuda.is_available():
    print("skipped: no CUDA device")
    raise SystemExit(0)
# the three default scenarios (16/4 and 16/16 heads of 128) and a Qwen3-8B-shaped one at longer lengths
raise SystemExit(main(["--memory", "--device", "cuda", "--backends", "flash,flash_copyfree", "--reps", "5",
                       "--warmup", "2", "--memory-scenario", "gqa", "--memory-scenario", "gqa-longresp",
                       "--memory-scenario", "mha", "--memory-scenario", "2,8,2048,512,32,8,128",
                       "--json", sys.argv[1]]))
PYEOF
MEM_RC=${PIPESTATUS[0]}

echo "== long-context rows (--long --preset gpu: verl FSDP engine, Ulysses SP = 2, 16K / 32K prompts)"
if [ "$NGPU" -lt 2 ]; then
    echo "skipped: SP = 2 runs one rank per GPU and $NGPU GPU(s) are visible" | tee "$OUT_DIR/gpu_long.log"
    LONG_RC=0
elif ! "$PY" -c "import verl, flash_attn" 2>/dev/null; then
    echo "skipped: verl 0.9 and flash-attn are needed for the stock SP engine" | tee "$OUT_DIR/gpu_long.log"
    LONG_RC=0
else
    timeout 900 "$PY" -m zorro_verl.bench --long --preset gpu --reps 3 --warmup 1 \
        --json "$OUT_DIR/gpu_long.json" 2>&1 | tee "$OUT_DIR/gpu_long.log"
    LONG_RC=${PIPESTATUS[0]}
fi
echo "== long-context rows (--long --long-engine verl-megatron --preset gpu: verl Megatron engine, CP = 2)"
if [ "$NGPU" -lt 2 ]; then
    echo "skipped: CP = 2 runs one rank per GPU and $NGPU GPU(s) are visible" | tee "$OUT_DIR/gpu_long_megatron.log"
elif ! "$PY" -c "import verl, megatron.bridge, transformer_engine" 2>/dev/null; then
    echo "skipped: verl 0.9, Megatron-Bridge and Transformer Engine are needed for the stock CP engine" \
        | tee "$OUT_DIR/gpu_long_megatron.log"
else
    timeout 900 "$PY" -m zorro_verl.bench --long --long-engine verl-megatron --preset gpu --reps 3 --warmup 1 \
        --json "$OUT_DIR/gpu_long_megatron.json" 2>&1 | tee "$OUT_DIR/gpu_long_megatron.log"
    MCORE_RC=${PIPESTATUS[0]}
    [ "$MCORE_RC" -eq 0 ] || LONG_RC=$MCORE_RC
fi

echo
echo "== summary: tests rc=$TESTS_RC (Ulysses: $SP_NOTE, rc=$SP_RC), ops rc=$OPS_RC, bench rc=$BENCH_RC (1: a target failed), tree rc=$TREE_RC, memory rc=$MEM_RC (1: flash_copyfree over stock), long rc=$LONG_RC (1: a count off its cost model), $(( $(date +%s) - T0 )) s; backends: $BACKENDS"
for f in gpu_ops gpu_bench; do
    if [ -f "$OUT_DIR/$f.json" ]; then
        echo
        "$PY" -c "
import json, sys
from zorro_verl.bench import PRESETS, check_targets, format_table
rows = json.load(open(sys.argv[1]))
print(format_table(rows))
for line in check_targets(rows, PRESETS['gpu'].targets):
    print(line)" "$OUT_DIR/$f.json"
    else
        echo "(no $f table: that run did not finish)"
    fi
done
if [ -f "$OUT_DIR/gpu_tree.json" ]; then
    echo
    "$PY" -c "
import json, sys
from zorro_verl.bench.tree import format_tree_table
print(format_tree_table(json.load(open(sys.argv[1]))))" "$OUT_DIR/gpu_tree.json"
fi
if [ -f "$OUT_DIR/gpu_memory.json" ]; then
    echo
    "$PY" -c "
import json, sys
from zorro_verl.bench.memory import check_memory_rule, format_memory_table
rows = json.load(open(sys.argv[1]))
print(format_memory_table(rows))
for line in check_memory_rule(rows):
    print(line)" "$OUT_DIR/gpu_memory.json"
else
    echo "(no gpu_memory table: that run did not finish)"
fi
for f in gpu_long gpu_long_megatron; do
    if [ -f "$OUT_DIR/$f.json" ]; then
        echo
        "$PY" -c "
import json, sys
from zorro_verl.bench.long_context import check_long_rows, format_long_table
rows = json.load(open(sys.argv[1]))
print(format_long_table(rows))
for line in check_long_rows(rows, 'bfloat16'):
    print(line)" "$OUT_DIR/$f.json"
    fi
done
[ "$TESTS_RC" -eq 0 ] && [ "$OPS_RC" -eq 0 ] && [ "$BENCH_RC" -eq 0 ] && [ "$TREE_RC" -eq 0 ] && [ "$MEM_RC" -eq 0 ] \
    && [ "$LONG_RC" -eq 0 ]
