"""MoE router statistics on zorro's Megatron path vs megatron's ordinary forward, fp64 on CPU (docs/design/megatron.md,
MoE; testing.md).

A 4-expert top-2 MoE ``GPTModel`` with the load-balancing loss per micro-batch and over the global batch, the z-loss
and the expert bias all on (tests/support/megatron_moe.py). The reference is megatron's own forward on the ordinary
rows (no project code), on a batch whose rows need no padding, so its statistics count exactly the ordinary tokens.
Compared: log-probs / entropy (<= 1e-12 absolute), every gradient — the losses reach them through megatron's
``MoEAuxLossAutoScaler`` — (<= 1e-12 relative to the parameter's largest entry), the logged MoE metrics (<= 1e-12
relative), the expert-bias token counts (equal integers) and the bias after megatron's update (equal). TP = 1 here,
prompt and prefix-tree plans; TP = 2 + sequence parallelism and expert parallelism EP = 2 over megatron's all-to-all
dispatcher in one 2-process gloo group (tests/support/megatron_moe_ranks.py). Plus the refusals, decided on the built
routers as megatron decides.
"""

from __future__ import annotations

import os
import warnings

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed here (run scripts/test_megatron.sh: "
                                            ".venv-megatron)")


import torch  # noqa: E402

from tests.support import megatron_cpu as M  # noqa: E402
from tests.support import megatron_moe as MM  # noqa: E402

TOL_VALUE = 1e-12
TOL_GRAD = 1e-12
TOL_METRIC = 1e-12
WORST: dict = {}


def check_case(case: str, res: dict) -> None:
    """The fp64 rules for one comparison of :func:`~tests.support.megatron_moe.compare_moe`."""
    WORST[case] = res
    print(f"{case}: " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items()))
    assert res["metrics_on"], (case, res)  # every statistic really ran on both sides
    assert res["logprob"] <= TOL_VALUE and res["entropy"] <= TOL_VALUE, (case, res)
    assert res["grad_rel"] <= TOL_GRAD, (case, res)
    assert res["metric_rel"] <= TOL_METRIC, (case, res)
    assert res["count"] == 0 and res["tokens"] > 0, (case, res)
    assert res["bias"] == 0 and res["bias_moved"], (case, res)


@pytest.fixture(scope="module")
def moe_pair(tmp_path_factory):
    warnings.filterwarnings("ignore", message="GPTModel IS DEPRECATED")
    M.init_megatron(0, 1, str(tmp_path_factory.mktemp("rdv") / "init"))
    M.fp64_moe_routing()
    kw = {"moe": True, "moe_overrides": MM.STATS, "config_hook": MM.expert_bias_on}
    stock = M.build_gpt(zorro=False, parallel_output=False, **kw)
    zorro = M.build_gpt(zorro=True, **kw)
    zorro.load_state_dict(stock.state_dict())
    return stock, zorro


@pytest.mark.parametrize("sharing", ["prompt", "prefix"])
def test_statistics_exact(moe_pair, sharing):
    from zorro_verl.integrations.megatron.moe import check_moe_statistics, token_multiplicity

    stock, zorro = moe_pair
    assert check_moe_statistics(zorro) == {"aux_loss", "global_aux_loss", "z_loss", "expert_bias"}
    batch = MM.make_uniform_batch(shared_prefix=sharing == "prefix")
    s = MM.run_moe(stock, batch, zorro=False)
    z = MM.run_moe(zorro, batch, zorro=True, sharing=sharing)
    plan = z["plan"]
    assert plan.T < plan.ordinary_tokens  # prompts really were deduplicated
    assert int(token_multiplicity(plan).sum()) == plan.ordinary_tokens == batch[1].sum()
    res = MM.compare_moe(s, z)
    assert res["tokens"] == 2 * plan.ordinary_tokens * res["routers"]  # top-2: every ordinary token counted twice
    for r in range(2):  # the zorro forward's weighting is gone afterwards: megatron's own methods again
        assert not any(name in vars(zorro.decoder.layers[r].mlp.router) for name in
                       ("_apply_aux_loss", "apply_z_loss", "_apply_expert_bias"))
    check_case(f"tp1_{sharing}", res)


def test_unweighted_differs(moe_pair, monkeypatch):
    """The comparison sees the weighting: without it (each packed token counted once) the logged losses, the
    token counts and the router gradients are off."""
    import contextlib

    from zorro_verl.integrations.megatron import step

    stock, zorro = moe_pair
    batch = MM.make_uniform_batch()
    s = MM.run_moe(stock, batch, zorro=False)
    monkeypatch.setattr(step, "TokenWeightedRouters", lambda *a, **k: contextlib.nullcontext())
    z = MM.run_moe(zorro, batch, zorro=True)
    res = MM.compare_moe(s, z)
    WORST["tp1_unweighted (expected off)"] = res
    print("unweighted (expected off):", res)
    assert res["metric_rel"] > 1e-3 and res["count"] >= 1 and res["grad_rel"] > 1e-6, res


def test_per_token_loss_scaling(moe_pair):
    """``calculate_per_token_loss``: megatron scales the router losses by its per-rank token count (the losses are
    then divided by the global token count in ``finalize_model_grads``); zorro scales by the ordinary count."""
    stock, zorro = moe_pair
    batch = MM.make_uniform_batch(seed=5)
    saved = [(r, r.calculate_per_token_loss) for m in (stock, zorro) for r in _routers(m)]
    try:
        for r, _ in saved:
            r.calculate_per_token_loss = True
        res = MM.compare_moe(MM.run_moe(stock, batch, zorro=False), MM.run_moe(zorro, batch, zorro=True))
    finally:
        for r, v in saved:
            r.calculate_per_token_loss = v
    check_case("tp1_per_token_loss", res)


def test_sigmoid_expert_bias_two_steps(moe_pair):
    """The aux-loss-free balancing as megatron allows it (sigmoid scores, the bias in the expert choice; DeepSeek-V3
    style, no aux loss) over two training steps: after the first update the bias changes which experts tokens go
    to, and the counts and the bias stay equal. Sigmoid scores are ``logits.float()`` (fp32 in an fp64 model), so
    the router gradients, which deduplication sums in another order before that fp32 backward, are compared in the
    softmax cases above only; the forward values and the integer counts here."""
    overrides = {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
                 "moe_router_load_balancing_type": "none", "moe_aux_loss_coeff": 0.0,
                 "moe_router_bias_update_rate": 0.2}
    stock = M.build_gpt(zorro=False, parallel_output=False, moe=True, moe_overrides=overrides)
    zorro = M.build_gpt(zorro=True, moe=True, moe_overrides=overrides)
    zorro.load_state_dict(stock.state_dict())
    from zorro_verl.integrations.megatron.moe import check_moe_statistics

    assert check_moe_statistics(zorro) == {"expert_bias"}
    batch = MM.make_uniform_batch(seed=7)
    steps = []
    for step in range(2):
        s = MM.run_moe(stock, batch, zorro=False, keep_bias=step > 0)
        z = MM.run_moe(zorro, batch, zorro=True, keep_bias=step > 0)
        steps.append((s, z))
        res = {"logprob": (z["lp"] - s["lp"]).abs().max().item(), "entropy": (z["ent"] - s["ent"]).abs().max().item(),
               "count": max((a - b).abs().max().item() for a, b in zip(s["counts"], z["counts"])),
               "bias": max((a - b).abs().max().item() for a, b in zip(s["bias"], z["bias"]))}
        WORST[f"tp1_sigmoid_bias_step{step}"] = res
        print(f"tp1_sigmoid_bias_step{step}:", res)
        assert res["logprob"] <= TOL_VALUE and res["entropy"] <= TOL_VALUE, res
        assert res["count"] == 0 and res["bias"] == 0, res
    # the first step's bias really moved the second step's routing
    assert any(not torch.equal(a, b) for a, b in zip(steps[0][0]["counts"], steps[1][0]["counts"]))


def _routers(model):
    from zorro_verl.integrations.megatron.moe import moe_routers

    return moe_routers(model)


def test_decided_on_the_built_routers(moe_pair):
    """verl's setting: ``moe_aux_loss_coeff`` from HF (0.001) with ``moe_router_load_balancing_type='none'`` has no
    aux loss in megatron (``is_aux_loss_enabled()`` False): nothing to weight, nothing refused. An expert bias
    with update rate 0 never moves: nothing to weight either."""
    from zorro_verl.integrations.megatron.moe import check_moe_statistics, moe_routers
    from zorro_verl.integrations.megatron.step import check_zorro_gpt

    _, zorro = moe_pair
    cfg = zorro.config
    saved = {k: getattr(cfg, k) for k in ("moe_router_load_balancing_type", "moe_aux_loss_coeff",
                                          "moe_z_loss_coeff", "moe_router_bias_update_rate")}
    routers = moe_routers(zorro)
    types = [r.routing_type for r in routers]
    try:
        cfg.moe_router_load_balancing_type, cfg.moe_aux_loss_coeff, cfg.moe_z_loss_coeff = "none", 0.001, None
        cfg.moe_router_bias_update_rate = 0.0
        for r in routers:
            r.routing_type = "none"
            assert not r.is_aux_loss_enabled()
        assert check_moe_statistics(zorro) == set()
        check_zorro_gpt(zorro)
    finally:
        for k, v in saved.items():
            setattr(cfg, k, v)
        for r, t in zip(routers, types):
            r.routing_type = t


def test_refusals(moe_pair):
    from zorro_verl.integrations.megatron import zorro_gpt_step
    from zorro_verl.integrations.megatron.moe import moe_routers
    from zorro_verl.packing import build_plan

    _, zorro = moe_pair
    ids, am, R = MM.make_uniform_batch()
    plan = build_plan(ids, am, R)
    cfg = zorro.config
    routers = moe_routers(zorro)
    cases = [({"moe_expert_capacity_factor": 1.0}, None, "moe_expert_capacity_factor"),
             ({"moe_token_dropping": True}, None, "moe_token_dropping"),
             ({"moe_router_load_balancing_type": "seq_aux_loss", "moe_aux_loss_coeff": 0.1}, "seq_aux_loss",
              "seq_aux_loss"),
             ({"moe_router_load_balancing_type": "sinkhorn"}, "sinkhorn", "sinkhorn"),
             ({"moe_router_load_balancing_type": "quantile_balancing"}, None, "quantile_balancing"),
             ({"moe_router_force_biased": 1.0}, None, "moe_router_force_biased"),
             ({"moe_enable_routing_replay": True}, None, "moe_enable_routing_replay"),
             ({"moe_router_force_load_balancing": True}, None, "moe_router_force_load_balancing"),
             ({"moe_input_jitter_eps": 0.01}, None, "moe_input_jitter_eps"),
             ({"recompute_granularity": "full"}, None, "recompute_granularity"),
             ({"recompute_granularity": "selective", "recompute_modules": ["moe"]}, None, "recompute_granularity"),
             # the statistics on under context parallelism: multiplicities not wired to the CP layout
             ({"context_parallel_size": 2}, None, "multiplicities are not wired to the CP layout")]
    for changes, routing_type, what in cases:
        saved = {k: getattr(cfg, k) for k in changes}
        types = [r.routing_type for r in routers]
        try:
            for k, v in changes.items():
                setattr(cfg, k, v)
            for r in routers:
                r.routing_type = routing_type or r.routing_type
            with pytest.raises(ValueError, match=what):
                zorro_gpt_step(zorro, plan)
        finally:
            for k, v in saved.items():
                setattr(cfg, k, v)
            for r, t in zip(routers, types):
                r.routing_type = t


def test_two_ranks_tp_sp_ep(tmp_path):
    """TP = 2 + sequence parallelism (each rank's router sees its shard of the packed row: its multiplicities
    sliced alike; prompt and prefix plans), EP = 2 (megatron's all-to-all dispatcher over gloo, a different batch
    per rank: the expert gradients and the global-batch statistics cross ranks) and PP = 2 (megatron's schedule,
    two micro-batches, a stage each), one 2-process gloo group."""
    from tests.support.multi_rank import run_ranks

    results = run_ranks("tests.support.megatron_moe_ranks", 2, [], tmp_path, timeout_s=int(os.environ.get(
        "ZORRO_MEGATRON_RANK_TIMEOUT", "900")))
    for rank, per_case in enumerate(results):
        assert set(per_case) == {"tp2_sp", "tp2_sp_prefix", "ep2", "pp2"}, per_case.keys()
        pp = per_case["pp2"]
        assert pp["stage"] == rank and pp["last"] == (rank == 1) and pp["routers"] == 1, pp
        if not pp["last"]:  # the first stage returns hidden states: gradients, metrics and routers compared
            pp.update(logprob=0.0, entropy=0.0)
        for case, res in per_case.items():
            assert res.pop("deduplicated"), (rank, case)
            check_case(f"{case}_rank{rank}", res)
        assert per_case["ep2"]["local_experts"] == 2 and per_case["ep2"]["dispatcher"] == "MoEAlltoAllTokenDispatcher"
        assert per_case["tp2_sp"]["sp"] and per_case["tp2_sp"]["T"] % 2 == 1  # zorro's row padded under SP


@pytest.mark.skipif(os.environ.get("ZORRO_MEGATRON_4RANKS", "1") == "0", reason="ZORRO_MEGATRON_4RANKS=0")
def test_four_ranks_ep2_tp2(tmp_path):
    """EP = 2 with TP = 2 + sequence parallelism (4 processes, 2 data-parallel ranks with a batch each, the expert
    tensor parallelism = TP, megatron's all-to-all dispatcher)."""
    from tests.support.multi_rank import run_ranks

    results = run_ranks("tests.support.megatron_moe_ranks", 4, [], tmp_path, timeout_s=int(os.environ.get(
        "ZORRO_MEGATRON_RANK_TIMEOUT", "900")))
    for rank, per_case in enumerate(results):
        res = per_case["ep2_tp2_sp"]
        assert res.pop("deduplicated") and res["sp"], (rank, res)
        assert res["local_experts"] == 2 and res["dispatcher"] == "MoEAlltoAllTokenDispatcher", res
        check_case(f"ep2_tp2_sp_rank{rank}", res)
