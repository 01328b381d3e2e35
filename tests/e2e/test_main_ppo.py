"""Real GRPO training through verl's ``python -m verl.trainer.main_ppo`` on CPU (vLLM CPU build for rollouts, FSDP2
actor and reference model over gloo), stock engine vs the zorro preset.

Runs (each a subprocess with a time limit, 2 steps, 4 prompts x ``rollout.n`` = 4, reference model + KL loss,
entropy bonus, fp32 actor/ref, the same seed):

* ``stock``     — the preset with ``zorro.enable=false`` (verl's stock engine methods), V1 trainer;
* ``zorro``     — the preset, V1 trainer; with ``stock``: identical settings otherwise (remove-padding and dynamic
  batch size on);
* ``zorro_v0``  — the preset with the V0 trainer (``trainer.use_v1=false``), fixed micro-batches;
* ``zorro_dp2`` — the preset with two training workers (data parallel 2, logical GPUs), fixed micro-batches.

``ZORRO_E2E_RUNS`` (comma-separated names) picks a subset; ``ZORRO_E2E_KEEP`` keeps the work dir.
The CPU platform and run-time patches are in tests/support/verl_cpu_e2e.py.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from tests.e2e.conftest import in_e2e_env

if not in_e2e_env():
    pytest.skip("end-to-end main_ppo runs need .venv-e2e's python (scripts/setup_e2e_env.sh; last step of "
                "scripts/test.sh)", allow_module_level=True)

from tests.e2e.runner import (  # noqa: E402
    base_overrides,
    expected_dedup,
    format_table,
    micro_batch_overrides,
    read_rollouts,
    rel_diff,
    run_main_ppo,
)
from tests.support.verl_cpu_e2e import cpu_overrides, e2e_env  # noqa: E402

pytestmark = pytest.mark.e2e

N = 4          # rollout.n
STEPS = 2
RTOL = 1e-4    # zorro vs stock, step-1 metrics
RUN_TIMEOUT_S = int(os.environ.get("ZORRO_E2E_RUN_TIMEOUT", "360"))

RUNS = {
    "stock": dict(zorro=False, v1=True, workers=1, dynamic=True),
    "zorro": dict(zorro=True, v1=True, workers=1, dynamic=True),
    "zorro_v0": dict(zorro=True, v1=False, workers=1, dynamic=False),
    "zorro_dp2": dict(zorro=True, v1=True, workers=2, dynamic=False),
}
SELECTED = [r.strip() for r in os.environ.get("ZORRO_E2E_RUNS", ",".join(RUNS)).split(",") if r.strip()]
ZORRO_RUNS = [r for r in SELECTED if RUNS[r]["zorro"]]

# step-1 metrics that must agree between zorro and stock (same rollouts): losses, entropy, grad norm, and the
# old-log-prob statistics verl logs against the rollout's log-probs; the KL loss is the reference log-probs' stat.
COMPARED = ["actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/ppo_kl",
            "training/rollout_probs_diff_mean", "training/rollout_probs_diff_max",
            "training/rollout_probs_diff_std", "training/rollout_actor_probs_pearson_corr",
            "critic/score/mean", "critic/advantages/mean", "response_length/mean", "prompt_length/mean"]

REPORT: list[str] = []


def _overrides(name: str, assets: dict, work: Path) -> list[str]:
    spec = RUNS[name]
    o = base_overrides(assets, out_dir=work / name, steps=STEPS, n=N)
    o += cpu_overrides(spec["workers"])
    o += micro_batch_overrides(dynamic=spec["dynamic"])
    o.append(f"trainer.use_v1={spec['v1']}")
    if not spec["zorro"]:
        o.append("actor_rollout_ref.actor.fsdp_config.zorro.enable=false")
    return o


@pytest.fixture(scope="session")
def work():
    d = Path(tempfile.mkdtemp(prefix="zorro_e2e_"))
    yield d
    if not os.environ.get("ZORRO_E2E_KEEP"):
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def assets(work):
    from tests.e2e.assets import build_assets

    return build_assets(work / "assets", dtype="bfloat16")


@pytest.fixture(scope="session")
def runs(work, assets):
    results = {}
    for name in SELECTED:
        res = run_main_ppo(name, _overrides(name, assets, work), work=work, env=e2e_env(),
                           python=sys.executable, timeout_s=RUN_TIMEOUT_S)
        print(f"\n[e2e] {name}: rc={res.returncode} {res.seconds:.0f}s peak {res.peak_rss_gb:.1f} GiB "
              f"steps={sorted(res.steps)} engine ranks={sorted(res.engine_ranks)}", flush=True)
        if res.returncode != 0:
            print(f"[e2e] {name} log tail ({res.log_path}):\n{res.tail(80)}", flush=True)
        results[name] = res
    _report(results, assets)
    return results


def _report(results: dict, assets: dict) -> None:
    rows = []
    for name, r in results.items():
        m = r.steps.get(1, {})
        dedup = next((v for k, v in m.items() if k.endswith("zorro/dedup_ratio")), None)
        exp = expected_dedup(m, N) if "prompt_length/mean" in m and "response_length/mean" in m else None
        rows.append((name, r.returncode, f"{r.seconds:.0f}", f"{r.peak_rss_gb:.1f}", max(r.steps, default=0),
                     "-" if dedup is None else f"{dedup:.4f}", "-" if exp is None else f"{exp:.4f}",
                     f"{r.steps.get(STEPS, {}).get('actor/kl_loss', float('nan')):.3e}"))
    lines = ["runs (wall s = whole subprocess incl. Ray/vLLM start; peak = process-tree RSS):"]
    lines += format_table(rows, ("run", "rc", "wall s", "peak GiB", "last step", "dedup (step 1)",
                                  "dedup expected", f"kl_loss step {STEPS}")).splitlines()
    if "stock" in results and "zorro" in results:
        s, z = results["stock"].steps.get(1, {}), results["zorro"].steps.get(1, {})
        rows = [(k, f"{s[k]:.8g}", f"{z[k]:.8g}", f"{rel_diff(s[k], z[k]):.2e}") for k in COMPARED
                if k in s and k in z]
        lines.append("")
        lines.append(f"step 1, zorro vs stock (same rollouts; rel = |a-b|/max(|a|,|b|,1e-6); bound {RTOL:g}):")
        lines += format_table(rows, ("metric", "stock", "zorro", "rel diff")).splitlines()
        s2, z2 = results["stock"].steps.get(2, {}), results["zorro"].steps.get(2, {})
        rows = [(k, f"{s2[k]:.8g}", f"{z2[k]:.8g}", f"{rel_diff(s2[k], z2[k]):.2e}") for k in COMPARED
                if k in s2 and k in z2]
        if rows:
            lines.append("")
            lines.append("step 2 (informational: rollouts come from each run's own updated weights):")
            lines += format_table(rows, ("metric", "stock", "zorro", "rel diff")).splitlines()
    lines.append(f"prompt token lengths of the dataset: {assets['prompt_lengths']}")
    REPORT[:] = lines


def _get(runs, name):
    if name not in runs:
        pytest.skip(f"run {name} not selected (ZORRO_E2E_RUNS)")
    return runs[name]


@pytest.mark.parametrize("name", list(RUNS))
def test_run_completes(e2e_required, runs, name):
    r = _get(runs, name)
    assert not r.timed_out, f"{name} ran past {RUN_TIMEOUT_S} s:\n{r.tail()}"
    assert r.returncode == 0, f"{name} exited {r.returncode}:\n{r.tail()}"
    assert sorted(r.steps) == list(range(1, STEPS + 1)), f"{name}: steps logged {sorted(r.steps)}:\n{r.tail()}"


@pytest.mark.parametrize("name", list(RUNS))
def test_engine_and_dedup(e2e_required, runs, name):
    r = _get(runs, name)
    spec = RUNS[name]
    if not spec["zorro"]:
        assert not r.engine_ranks, "stock run logged the zorro engine line"
        assert not any("zorro/dedup_ratio" in k for k in r.steps.get(1, {}))
        return
    assert r.engine_ranks == set(range(spec["workers"])), f"zorro engine line on ranks {sorted(r.engine_ranks)}"
    for step in range(1, STEPS + 1):
        m = r.steps[step]
        dedup = [v for k, v in m.items() if k.endswith("zorro/dedup_ratio")]
        assert dedup, f"{name} step {step}: no zorro/dedup_ratio metric"
        fallbacks = [v for k, v in m.items() if k.endswith("zorro/fallback_batches")]
        assert fallbacks and all(v == 0 for v in fallbacks), f"{name} step {step}: fallback_batches {fallbacks}"
        exp = expected_dedup(m, N)
        assert dedup[0] > 1.0
        # prompt tokens saved: (n - 1) of each group's n prompt copies; the logged value is the mean over ranks
        saved = [v for k, v in m.items() if k.endswith("zorro/prompt_tokens_saved")]
        n_rows = 4 * N
        exp_saved = n_rows * m["prompt_length/mean"] * (N - 1) / N / spec["workers"]
        assert saved and saved[0] == pytest.approx(exp_saved, rel=1e-6), f"{name} step {step}: {saved} vs {exp_saved}"
        if spec["workers"] == 1:
            # one rank sees the whole batch, groups whole in a micro-batch: exact
            assert dedup[0] == pytest.approx(exp, rel=1e-6), f"{name} step {step}: {dedup[0]} vs {exp}"
        else:
            # the logged value is the mean over ranks of each rank's own ratio (ranks hold different groups, whose
            # per-rank token counts the logs do not give): close to, not equal to, the whole batch's ratio
            assert dedup[0] == pytest.approx(exp, rel=0.05), f"{name} step {step}: {dedup[0]} vs {exp}"


def test_prompt_lengths_match_dataset(e2e_required, runs, assets):
    lens = assets["prompt_lengths"]
    for name, r in runs.items():
        for step in range(1, STEPS + 1):
            got = r.steps.get(step, {}).get("prompt_length/mean")
            assert got == pytest.approx(sum(lens) / len(lens), rel=1e-6), f"{name} step {step}: {got} vs {lens}"


@pytest.mark.parametrize("name", list(RUNS))
def test_rollout_matches_actor_and_kl(e2e_required, runs, name):
    r = _get(runs, name)
    for step in range(1, STEPS + 1):
        m = r.steps[step]
        assert m.get("training/rollout_probs_diff_valid") == 1, f"{name} step {step}: no rollout-vs-actor metrics"
        # vLLM rolls out in bf16 from synced weights, the actor recomputes in fp32
        assert m["training/rollout_actor_probs_pearson_corr"] > 0.99, m["training/rollout_actor_probs_pearson_corr"]
        assert m["training/rollout_probs_diff_mean"] < 0.02, m["training/rollout_probs_diff_mean"]
        assert m["actor/grad_norm"] > 0
    assert r.steps[STEPS]["actor/kl_loss"] > 0, f"{name}: step-{STEPS} KL loss {r.steps[STEPS]['actor/kl_loss']}"


def test_zorro_vs_stock_step1(e2e_required, runs):
    s, z = _get(runs, "stock"), _get(runs, "zorro")
    # the same rollouts: verl's rollout dump (prompt, response text, reward, per uid) is identical
    rs, rz = read_rollouts(s.rollout_dir, 1), read_rollouts(z.rollout_dir, 1)
    assert len(rs) == len(rz) == 4 * N
    key = [(a["input"], a["output"], a["score"]) for a in rs]
    assert key == [(a["input"], a["output"], a["score"]) for a in rz], "step-1 rollouts differ between the runs"
    ms, mz = s.steps[1], z.steps[1]
    for k in ("response_length/mean", "prompt_length/mean"):
        assert ms[k] == mz[k], k
    bad = {k: (ms[k], mz[k], rel_diff(ms[k], mz[k])) for k in COMPARED if rel_diff(ms[k], mz[k]) > RTOL}
    assert not bad, f"zorro vs stock step-1 metrics beyond {RTOL}: {bad}"


def test_zorro_vs_stock_step2_kl(e2e_required, runs):
    """Step 1's actor equals its reference (KL loss 0 in both runs); after one update the KL loss is the reference
    log-probs' real test. Step-2 rollouts come from each run's own updated weights (synced to a bf16 vLLM); when
    they are identical, the step-2 KL loss, entropy and grad norm must agree too."""
    s, z = _get(runs, "stock"), _get(runs, "zorro")
    same = [(a["input"], a["output"]) for a in read_rollouts(s.rollout_dir, 2)] == \
        [(a["input"], a["output"]) for a in read_rollouts(z.rollout_dir, 2)]
    if not same:
        pytest.skip("step-2 rollouts differ (the two updates differ by fp32 rounding, vLLM samples in bf16)")
    ms, mz = s.steps[2], z.steps[2]
    assert ms["actor/kl_loss"] > 0
    bad = {k: (ms[k], mz[k], rel_diff(ms[k], mz[k])) for k in ("actor/kl_loss", "actor/entropy", "actor/grad_norm")
           if rel_diff(ms[k], mz[k]) > RTOL}
    assert not bad, f"zorro vs stock step-2 metrics beyond {RTOL}: {bad}"
