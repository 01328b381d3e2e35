"""zorro's Megatron value-head (critic) engine vs verl 0.9.1's stock ``MegatronEngineWithValueHead``, fp32 on the CPU,
and zorro's value step on megatron-core's GPTModel vs megatron's ordinary forward, fp64 (docs/design/megatron.md
"The Megatron critic", testing.md).

Engines (one 2-process gloo group, tests/support/megatron_value_ranks.py): both built by Megatron-Bridge (verl's
default) from the same tiny Qwen3 checkpoint with verl's value head (``LinearForLastLayer``; zorro's set to the stock
one's), the stock one on verl's padded path (megatron's own attention: no project code). TP = 1 (DP = 2, unequal
shares, dynamic token budget) and TP = 2 + sequence parallel (fixed micro-batch size); two steps as the trainer runs
them, ``compute_values`` then ``update_critic`` (verl's ``value_loss`` with value clipping, one SGD step), each on a
new GRPO batch. Tolerances (fp32, docs/design/testing.md's engine bound, as the other engine tests): values at the
positions verl reads 1e-5 absolute (values ~1), value loss and grad norm 1e-5 relative, every gradient 1e-5
relative to its parameter's largest entry, at both steps; zorro's metrics present, no stock fallback.

Model level (fp64): the value path (packed row, value head at every row, the response-predicting rows picked) against
megatron's ordinary forward, values and every gradient <= 1e-12, TP = 1 in-process (prompt and prefix plans, and the
output_layer path of megatron-core < 0.19) and TP = 2 + SP in the engine test's processes.
"""

from __future__ import annotations

import os
import warnings

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed here (run scripts/test_megatron.sh: "
                                            ".venv-megatron)")

import torch  # noqa: E402

from tests.support import megatron_cpu as M  # noqa: E402

#: fp32 engines (docs/design/testing.md: 1e-5 for the verl engine comparisons over two SGD steps)
TOL_VALUE = 1e-5
TOL_REL = 1e-5
#: fp64 model level
TOL_FP64 = 1e-12


@pytest.fixture(scope="module")
def megatron_tp1(tmp_path_factory):
    from tests.support import megatron_value as V

    warnings.filterwarnings("ignore", message="GPTModel IS DEPRECATED")
    M.init_megatron(0, 1, str(tmp_path_factory.mktemp("rdv") / "init"))
    stock = V.value_gpt(zorro=False)
    zorro = V.value_gpt(zorro=True)
    zorro.load_state_dict(stock.state_dict())
    return stock, zorro


@pytest.mark.parametrize("path", ["output_processor", "output_layer"])
@pytest.mark.parametrize("sharing", ["prompt", "prefix"])
def test_value_step_fp64_tp1(megatron_tp1, monkeypatch, sharing, path):
    from tests.support import megatron_value as V
    from zorro_verl.integrations.megatron import step

    if path == "output_layer":  # megatron-core < 0.19 (forced here): the model's own head call on every row
        monkeypatch.setattr(step, "has_output_processor", lambda: False)
    stock, zorro = megatron_tp1
    stock.zero_grad(set_to_none=True)
    zorro.zero_grad(set_to_none=True)
    ids, am, R = M.make_batch(shared_prefix=sharing == "prefix")
    s = V.stock_values(stock, ids, am, R)
    z, plan = V.zorro_values_of(zorro, ids, am, R, sharing=sharing)
    assert plan.T < plan.ordinary_tokens and z.numel() == plan.N == 15 and z.dtype == torch.float64
    res = V.compare_values(s, z, M.grads(stock), M.grads(zorro))
    print(f"zorro vs megatron value model (fp64) tp1 {sharing} {path}: {res}")
    assert res["params"] == len(list(zorro.parameters())) and res["scale"] > 0.1
    assert res["values"] <= TOL_FP64 and res["grad_rel"] <= TOL_FP64, res


def test_value_head_refused(megatron_tp1):
    """A zorro value step on a model whose head is not a per-token Linear(H, 1) (the LM head) is refused by name."""
    from zorro_verl.integrations.megatron import zorro_gpt_forward
    from zorro_verl.packing import build_plan

    lm = M.build_gpt(zorro=True)
    ids, am, R = M.make_batch()
    with pytest.raises(ValueError, match="whose output_layer is a per-token value head"):
        zorro_gpt_forward(lm, build_plan(ids, am, R), value_head=True)


@pytest.fixture(scope="module")
def engine_results(tmp_path_factory):
    from tests.support import megatron_bridge_cpu
    from tests.support.multi_rank import run_ranks

    megatron_bridge_cpu.require_bridge()
    tmp = tmp_path_factory.mktemp("megatron_value_engine")
    return run_ranks("tests.support.megatron_value_ranks", 2, [str(tmp / "ckpt")], tmp,
                     timeout_s=int(os.environ.get("ZORRO_MEGATRON_RANK_TIMEOUT", "1500")))


@pytest.mark.parametrize("layout", ["tp1", "tp2_sp"])
def test_critic_engine_equals_stock(engine_results, layout):
    counts = []
    for rank, res in enumerate(engine_results):
        r = res[layout]
        built = r["built"]
        assert built["stock"] == "MegatronEngineWithValueHead", built
        assert built["zorro"] == "ZorroMegatronEngineWithValueHead", built
        assert built["head"] == "LinearForLastLayer" and built["head_shape"] == [1, 64], built
        assert not built["vanilla"] and built["provider"] is not None, built  # built by Megatron-Bridge
        assert built["same_keys"] and built["init_params"] == 0.0, built
        for step in ("step1", "step2"):
            s = r[step]
            assert s["n_params"] > 0 and s["grad_rel"] <= TOL_REL, (rank, step, s)
            assert s["head_grad"] is not None and s["head_grad"] > 0, (rank, step, s)  # the value head trains
            if "values" in s:  # a rank with outputs
                assert s["values_scale"] > 0.1 and s["values"] <= TOL_VALUE, (rank, step, s)
                assert abs(s["loss"]) > 1e-4 and s["loss_rel"] <= TOL_REL, (rank, step, s)
                assert s["infer_fallback"] == 0.0 and s["train_fallback"] == 0.0, (rank, step, s)
                assert s["infer_dedup_ratio"] > 1.0 and s["train_dedup_ratio"] > 1.0, (rank, step, s)
                assert {"zorro/dedup_ratio", "zorro/prompt_tokens_saved", "zorro/fallback_batches"} \
                    <= set(s["zorro_metrics"]), s["zorro_metrics"]
                assert set(s["stock_metrics"]) <= set(s["zorro_stock_metrics"]), s  # verl's critic metrics too
                assert {"critic/vf_loss", "critic/vf_clipfrac"} <= set(s["stock_metrics"]), s["stock_metrics"]
                counts.append(s["n_values"])
            if "grad_norm_rel" in s:
                assert s["grad_norm"] > 1e-5 and s["grad_norm_rel"] <= TOL_REL, (rank, step, s)
            print(f"zorro vs stock Megatron critic (fp32) {layout} {step} rank {rank}: "
                  + ", ".join(f"{k} {v:.2g}" for k, v in s.items() if isinstance(v, float)))
        print(f"  {layout} rank {rank}: {r['seconds']:.0f} s")
    # several micro-batches, the same count on every rank (megatron's schedule and DDP need it)
    n_mb = {res[layout][step]["n_micro_batches"] for res in engine_results for step in ("step1", "step2")}
    assert len(n_mb) == 1 and n_mb.pop() > 1, n_mb
    # the batch's 38 response tokens per step: split over the DP ranks (TP = 1), on both TP ranks (TP = 2)
    assert sum(counts) == {"tp1": 2 * 38, "tp2_sp": 4 * 38}[layout], counts


def test_value_step_fp64_tp2_sp(engine_results):
    for rank, res in enumerate(engine_results):
        for sharing, r in res["fp64_tp2_sp"].items():
            if sharing == "seconds":
                continue
            print(f"zorro vs megatron value model (fp64) tp2+sp {sharing} rank {rank}: {r}")
            assert r["sp"] and r["dedup"] and r["ranks_equal"], r
            assert r["scale"] > 0.1 and r["values"] <= TOL_FP64 and r["grad_rel"] <= TOL_FP64, (rank, sharing, r)
