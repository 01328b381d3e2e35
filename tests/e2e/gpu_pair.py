"""The zorro-vs-stock pair of tests/e2e on one CUDA GPU with the real vLLM and bf16 (run by scripts/gpu_e2e.sh).

Same assets, GRPO settings, seed and checks as the CPU test, but no CPU platform or CPU patches (only the per-request
rollout seeds of tests/support/verl_seeded_rollout_plugin.py, so both runs get the same rollouts): verl's own CUDA
platform, FSDP2 in bf16, vLLM's CUDA rollout. Prints the same tables; exits non-zero when a run fails, the
step-1 rollouts differ, or a step-1 metric differs by more than ``--rtol`` (bf16: default 1e-2).

    python -m tests.e2e.gpu_pair [--work DIR] [--rtol 1e-2] [--timeout 900]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from tests.e2e.assets import build_assets
from tests.e2e.runner import (
    base_overrides,
    expected_dedup,
    format_table,
    micro_batch_overrides,
    read_rollouts,
    rel_diff,
    run_main_ppo,
)

N, STEPS = 4, 2
COMPARED = ["actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/ppo_kl",
            "training/rollout_probs_diff_mean", "training/rollout_probs_diff_max",
            "training/rollout_probs_diff_std", "training/rollout_actor_probs_pearson_corr",
            "critic/score/mean", "critic/advantages/mean", "response_length/mean", "prompt_length/mean"]


def gpu_env(plugin: str = "tests.support.verl_seeded_rollout_plugin") -> dict:
    """Environment of a GPU ``main_ppo`` run: offline, no telemetry, this repository on the path, ``plugin`` loaded
    at ``import verl`` in every process (default: only the per-request rollout seeds)."""
    return {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled",
            "RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "0", "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false", "VLLM_NO_USAGE_STATS": "1",
            "VERL_USE_EXTERNAL_MODULES": plugin,
            "PYTHONPATH": str(Path(__file__).resolve().parents[2]) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def overrides(assets: dict, work: Path, name: str, zorro: bool) -> list[str]:
    o = base_overrides(assets, out_dir=work / name, steps=STEPS, n=N, dtype="bf16")
    o += micro_batch_overrides(dynamic=True)
    o += ["trainer.n_gpus_per_node=1", "trainer.nnodes=1", "trainer.use_v1=True",
          "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
          "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",  # flash-attn may be absent
          "actor_rollout_ref.actor.fsdp_config.model_dtype=bf16", "actor_rollout_ref.ref.fsdp_config.model_dtype=bf16",
          "transfer_queue.backend.SimpleStorage.num_data_storage_units=1"]
    if not zorro:
        o.append("actor_rollout_ref.actor.fsdp_config.zorro.enable=false")
    return o


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--work", default=None)
    ap.add_argument("--rtol", type=float, default=1e-2)
    ap.add_argument("--timeout", type=int, default=900)
    a = ap.parse_args()
    work = Path(a.work or tempfile.mkdtemp(prefix="zorro_gpu_e2e_"))
    assets = build_assets(work / "assets", dtype="bfloat16")
    results = {}
    for name, zorro in (("stock", False), ("zorro", True)):
        r = run_main_ppo(name, overrides(assets, work, name, zorro), work=work, env=gpu_env(),
                         python=sys.executable, timeout_s=a.timeout)
        print(f"[gpu-e2e] {name}: rc={r.returncode} {r.seconds:.0f}s steps={sorted(r.steps)} "
              f"engine ranks={sorted(r.engine_ranks)} log={r.log_path}", flush=True)
        results[name] = r
    failures = []
    for name, r in results.items():
        if r.returncode != 0 or sorted(r.steps) != list(range(1, STEPS + 1)):
            failures.append(f"{name}: rc={r.returncode}, steps {sorted(r.steps)}\n{r.tail(40)}")
    if failures:
        print("\n".join(failures))
        return 1
    s, z = results["stock"], results["zorro"]
    if z.engine_ranks != {0}:
        failures.append(f"zorro engine line on ranks {sorted(z.engine_ranks)}")
    ms, mz = s.steps[1], z.steps[1]
    dedup = next((v for k, v in mz.items() if k.endswith("zorro/dedup_ratio")), float("nan"))
    exp = expected_dedup(mz, N)
    if not abs(dedup - exp) <= 1e-6 * exp:
        failures.append(f"dedup ratio {dedup} != expected {exp}")
    if any(v != 0 for k, v in mz.items() if k.endswith("zorro/fallback_batches")):
        failures.append("zorro fell back to the stock forward")
    same = [(x["input"], x["output"], x["score"]) for x in read_rollouts(s.rollout_dir, 1)] == \
        [(x["input"], x["output"], x["score"]) for x in read_rollouts(z.rollout_dir, 1)]
    if not same:
        failures.append("step-1 rollouts differ between stock and zorro (vLLM sampling not reproducible here)")
    rows = [(k, f"{ms[k]:.8g}", f"{mz[k]:.8g}", f"{rel_diff(ms[k], mz[k]):.2e}") for k in COMPARED
            if k in ms and k in mz]
    print(format_table([(n, f"{r.seconds:.0f}", f"{r.peak_rss_gb:.1f}", max(r.steps)) for n, r in results.items()],
                       ("run", "wall s", "peak host GiB", "last step")))
    print(f"\nzorro dedup ratio (step 1): {dedup:.4f} (expected {exp:.4f}); step-1 rollouts identical: {same}")
    print(f"\nstep 1, zorro vs stock, bf16 on GPU (bound {a.rtol:g} relative):")
    print(format_table(rows, ("metric", "stock", "zorro", "rel diff")))
    bad = [k for k in COMPARED if k in ms and k in mz and rel_diff(ms[k], mz[k]) > a.rtol]
    if bad and same:
        failures.append(f"metrics beyond {a.rtol}: {bad}")
    if z.steps[STEPS].get("actor/kl_loss", 0) <= 0:
        failures.append("step-2 KL loss is not > 0")
    print("\n" + ("FAILED:\n  " + "\n  ".join(failures) if failures else "OK"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
