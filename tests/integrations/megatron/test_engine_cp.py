"""zorro's Megatron engine under static context parallelism (docs/design/megatron.md "The Megatron engine under
context parallelism"), fp32 on the CPU: verl 0.9.1's engine built by Megatron-Bridge, one 4-process gloo group
(tests/support/megatron_engine_cp_ranks.py). zorro at CP = 2 x TP = 2 + sequence parallel, at CP = 2 x PP = 2 and at
CP = 2 (DP = 2) against zorro at CP = 1 and verl's stock engine at CP = 1 on the same GRPO batch: log-probs /
entropy, the loss, every parameter's gradient and every parameter after each of two SGD steps; prompt sharing (fixed
micro-batches, dynamic budget) and ``sharing=prefix``; megatron's ordinary loss regime and its per-token regime
(``calculate_per_token_loss=True``, asserted on), where a control run with verl's own CP token count (``n // cp`` on
every CP rank) shows the gradients would be off; verl's Megatron critic (value-head engine) at CP = 2 x DP = 2 in
both regimes, two compute_values + update_critic steps. Megatron's local attention has no CP exchange, so stock CP
(Transformer Engine) is compared on a GPU (test_gpu_context_parallel.py).

Tolerances (fp32, test_engine.py's): values 2e-6 absolute; loss 1e-6 relative; gradients 5e-6 relative to each
parameter's largest entry at the first step, 1e-5 at the second (the weights already one step's rounding apart);
parameters 1e-7 absolute after one SGD step (lr 1e-3), 2e-7 after two.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed here (run scripts/test_megatron.sh: "
                                            ".venv-megatron)")

from tests.support.megatron_bridge_cpu import require_bridge  # noqa: E402

TOL_VALUE = 2e-6
TOL_SCALAR_REL = 1e-6
TOL_GRAD = 5e-6
TOL_GRAD_LATER_STEP = 1e-5
TOL_PARAM = 1e-7
#: the cases of the rank script and their (CP, TP, PP, DP, SP, per-token regime)
CASES = {"cp2tp2/fixed": (2, 2, 1, 1, True, True), "cp2pp2/fixed": (2, 1, 2, 1, False, True),
         "cp2/fixed": (2, 1, 1, 2, False, False), "cp2/dynamic": (2, 1, 1, 2, False, True),
         "cp2/prefix": (2, 1, 1, 2, False, True)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from tests.support.multi_rank import run_ranks

    require_bridge()
    if os.environ.get("ZORRO_MEGATRON_4RANKS", "1") == "0":
        pytest.skip("ZORRO_MEGATRON_4RANKS=0")
    tmp = tmp_path_factory.mktemp("megatron_engine_cp")
    return run_ranks("tests.support.megatron_engine_cp_ranks", 4, [str(tmp / "ckpt")], tmp,
                     timeout_s=int(os.environ.get("ZORRO_MEGATRON_RANK_TIMEOUT", "900")))


def _check(r, where, last_stage=True):
    if last_stage:  # outputs and losses: the last pipeline stage
        assert r["log_probs"] <= TOL_VALUE and r["entropy"] <= TOL_VALUE, where
        assert r["step1/loss_rel"] <= TOL_SCALAR_REL and r["step2/loss_rel"] <= TOL_SCALAR_REL, where
    assert r["step1/grad_rel"] <= TOL_GRAD and r["step2/grad_rel"] <= TOL_GRAD_LATER_STEP, where
    assert r["step1/params"] <= TOL_PARAM and r["step2/params"] <= 2 * TOL_PARAM, where


@pytest.mark.parametrize("case", sorted(CASES))
def test_zorro_cp_engine_equals_cp1(results, case):
    cp, tp, pp, dp, sp, per_token = CASES[case]
    last = 0
    for rank, res in enumerate(results):
        r = res[case]
        assert (r["cp"], r["tp"], r["pp"], r["dp"], r["sp"], r["per_token_loss"]) == (cp, tp, pp, dp, sp, per_token), \
            (rank, r)
        assert r["deduplicated"] and r["n_params"] > 0, (rank, r)
        if r["last_stage"]:
            last += 1
            # zorro's deduplicated forward ran: no fallback, prompts computed fewer times
            m = r["metrics"]
            assert m["zorro/fallback_batches"] == 0.0 and m["train/zorro/fallback_batches"] == 0.0, (rank, m)
            assert m["zorro/dedup_ratio"] > 1.2, (rank, m)
            assert r["n_tokens"] == 38, (rank, r)
        for ref in ("vs_stock", "vs_zorro_cp1"):
            _check(r[ref], (rank, case, ref, r[ref]), r["last_stage"])
        print(f"zorro CP={cp} TP={tp} PP={pp} DP={dp} ({'per-token' if per_token else 'ordinary'} regime) {case} "
              f"rank {rank}: "
              + "; ".join(f"{ref}: " + ", ".join(f"{k} {v:.2g}" for k, v in r[ref].items())
                          for ref in ("vs_stock", "vs_zorro_cp1")))
    assert last == (2 if pp > 1 else 4)  # the ranks with outputs: the last stage's CP ranks (PP = 2), else all


def test_stock_cp2_standin_and_zorro_at_the_same_sharding(results):
    """verl's **stock** engine at CP = 2 on its THD path (the CPU stand-in of Transformer Engine's CP attention,
    tests/support/megatron_cp_stock.py) equals stock at CP = 1 (so the stand-in computes TE's CP attention), and
    zorro at CP = 2 equals it: zorro and stock at the same sharding, two SGD steps, the bounds above."""
    for rank, res in enumerate(results):
        r = res["stock_cp2/fixed"]
        assert (r["cp"], r["dp"]) == (2, 2), (rank, r)
        _check(r["vs_stock"], (rank, "stock_cp2 vs stock cp1", r["vs_stock"]))
        z = res["cp2/fixed"]["vs_stock_cp2"]
        _check(z, (rank, "zorro cp2 vs stock cp2", z))
        print(f"rank {rank}: stock CP=2 (stand-in) vs stock CP=1: "
              + ", ".join(f"{k} {v:.2g}" for k, v in r["vs_stock"].items())
              + "; zorro CP=2 vs stock CP=2: " + ", ".join(f"{k} {v:.2g}" for k, v in z.items()))


@pytest.mark.parametrize("case, per_token", [("critic_cp2/fixed", False), ("critic_cp2_per_token/fixed", True)])
def test_zorro_cp_critic_equals_cp1(results, case, per_token):
    """verl's Megatron critic (value-head engine) at CP = 2 x DP = 2, two compute_values + update_critic steps: the
    values at the positions verl reads (~1) within 2e-6 absolute, the value loss 1e-6 relative, the gradients and
    parameters at the bounds above, against zorro's critic and verl's stock critic at CP = 1."""
    for rank, res in enumerate(results):
        r = res[case]
        assert (r["cp"], r["dp"], r["per_token_loss"]) == (2, 2, per_token) and r["deduplicated"], (rank, r)
        m = r["metrics"]
        assert m["zorro/fallback_batches"] == 0.0 and m["train/zorro/fallback_batches"] == 0.0, (rank, m)
        assert m["zorro/dedup_ratio"] > 1.2 and r["n_values"] == 38 and r["values_scale"] > 0.1, (rank, r)
        for ref in ("vs_stock", "vs_zorro_cp1"):
            d = r[ref]
            where = (rank, case, ref, d)
            assert d["step1/values"] <= TOL_VALUE and d["step2/values"] <= TOL_VALUE, where
            assert d["step1/loss_rel"] <= TOL_SCALAR_REL and d["step2/loss_rel"] <= TOL_SCALAR_REL, where
            assert d["step1/grad_rel"] <= TOL_GRAD and d["step2/grad_rel"] <= TOL_GRAD_LATER_STEP, where
            assert d["step1/params"] <= TOL_PARAM and d["step2/params"] <= 2 * TOL_PARAM, where
        print(f"zorro critic CP=2 DP=2 {case} rank {rank}: "
              + "; ".join(f"{ref}: " + ", ".join(f"{k} {v:.2g}" for k, v in r[ref].items())
                          for ref in ("vs_stock", "vs_zorro_cp1")))


def test_per_token_count_is_exact(results):
    """In the per-token regime megatron divides every gradient by the summed counts of the loss function. The batch
    has micro-batches with an odd token count (CP = 2), where verl's own count (``n // cp`` on every CP rank) sums to
    less than the routed tokens verl scales each loss by: the control run with it is off by that ratio, zorro's exact
    share is not (test_zorro_cp_engine_equals_cp1)."""
    for rank, res in enumerate(results):
        r = res["cp2/floor_count"]
        assert r["per_token_loss"] and any(n % 2 for n in r["micro_batch_tokens"]), (rank, r)
        assert r["vs_stock"]["step1/grad_rel"] > 1e-3, (rank, r["vs_stock"])
        print(f"verl's CP token count (n // cp) instead of zorro's exact share, rank {rank}: grad_rel "
              f"{r['vs_stock']['step1/grad_rel']:.2g} (micro-batch tokens {r['micro_batch_tokens']})")
    print("wall seconds (rank 0):", {k: round(v, 1) for k, v in results[0]["seconds"].items()})


def test_still_refused_by_name(results):
    """MoE models at CP > 1, and MoE router losses in the per-token regime, are refused once the model is built."""
    for res in results:
        r = res["refusals"]
        assert r["moe_cp2"] and "MoE models under context parallelism" in r["moe_cp2"], r
        assert "context_parallel_size=1" in r["moe_cp2"], r
        per_token = r["moe_aux_loss_per_token"]
        assert per_token and "calculate_per_token_loss=True with MoE router losses on (['aux_loss'])" in per_token, r
        assert "calculate_per_token_loss=False" in per_token, r
