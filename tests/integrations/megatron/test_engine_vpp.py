"""zorro's Megatron engine with virtual pipeline stages, ``use_fused_kernels``, the per-token random ops refused in
training and the position-id check before the ranks agree (docs/design/megatron.md "The Megatron engine", testing.md).

Engine level (one 2-process gloo group, tests/support/megatron_engine_vpp_ranks.py): PP = 2 x VPP = 2 on a 4-layer
Qwen3 checkpoint (one layer per model chunk; megatron's interleaved 1F1B schedule with verl's ``overlap_p2p_comm`` /
``batch_p2p_comm=False``), zorro vs verl's stock engine (padded bshd path, megatron's own attention: no project code)
in fp32: ``infer_batch`` log-probs / entropy, ``train_batch`` loss and grad norm, every gradient of every model chunk
of both stages and the parameters after one SGD step; fixed micro-batch sizes (also one whose group-aware count, 3,
is rounded up to the interleaved group's multiple, 4), a dynamic token budget, and ``use_fused_kernels=True`` (zorro's
head replaces verl's fused one; verl's fused kernel is Triton, CUDA only, so the CPU reference is the stock
non-fused head; tests/integrations/megatron/test_gpu.py compares to the stock fused engine on a GPU). Tolerances as
test_engine.py. Each of these once per model builder (Megatron-Bridge, verl's default, then vanilla mbridge, in the
same processes). Then: ``hidden_dropout`` / ``attention_dropout`` refused by name at ``initialize`` (a trainable
engine), accepted on a forward-only engine (eval mode: dropout off, equal to the stock engine); bad position ids on
one rank only: every rank raises (none waits in a collective).

Model level (in-process): ``zorro_gpt_step`` refuses dropout and MoE input jitter in training, and the MoE router
settings that are statistics over the micro-batch's tokens (sinkhorn, quantile balancing, forced biases).
"""

from __future__ import annotations

import os
import warnings

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed here (run scripts/test_megatron.sh: "
                                            ".venv-megatron)")

from tests.support.megatron_bridge_cpu import results_on  # noqa: E402

TOL_VALUE = 2e-6
TOL_SCALAR_REL = 1e-6
TOL_GRAD = 5e-6
TOL_PARAM = 1e-7
CASES = ("vpp/fixed", "vpp/dynamic", "vpp/fixed4", "fused/dynamic")


@pytest.fixture(scope="module")
def vpp_results(tmp_path_factory):
    from tests.support.multi_rank import run_ranks

    tmp = tmp_path_factory.mktemp("megatron_engine_vpp")
    return run_ranks("tests.support.megatron_engine_vpp_ranks", 2, [str(tmp / "ckpt")], tmp,
                     timeout_s=int(os.environ.get("ZORRO_MEGATRON_RANK_TIMEOUT", "900")))


#: verl's two Megatron model builders, Megatron-Bridge (its default) first
BRIDGES = ("megatron-bridge", "mbridge")


@pytest.fixture(params=BRIDGES)
def bridge_results(vpp_results, request):
    """Each rank's comparisons on one builder (Megatron-Bridge required where scripts/test_megatron.sh runs)."""
    bridge = request.param
    results = results_on(vpp_results, bridge)
    assert all(r["vanilla"] == (bridge == "mbridge") for r in results), bridge  # the builder that made the engines
    return results


def test_vpp_layout(bridge_results):
    """Each stage holds two model chunks of one layer; the head (post_process) only on the last chunk of the last
    stage, the embedding only on the first chunk of the first; verl's interleaved-schedule settings."""
    assert [r["chunks"] for r in bridge_results] == [[[1, True, False], [1, False, False]],
                                                    [[1, False, False], [1, False, True]]]
    for r in bridge_results:
        assert r["tf_config"] == {"virtual_pipeline_model_parallel_size": 2, "overlap_p2p_comm": True,
                                  "batch_p2p_comm": False, "variable_seq_lengths": True,
                                  "microbatch_group_size_per_vp_stage": 2}, r["tf_config"]


@pytest.mark.parametrize("case", CASES)
def test_vpp_engine_equals_stock(bridge_results, case):
    for rank, res in enumerate(bridge_results):
        r = res[case]
        assert r["grad_chunks"] == ["chunk0", "chunk1"] and r["n_params"] > 0, (rank, r)
        assert r["grad_rel"] <= TOL_GRAD and r["param_after_step"] <= TOL_PARAM, (rank, r)
        assert r["n_micro_batches"] % 2 == 0, r  # the interleaved schedule's group of 2
        if rank == 1:  # the last stage: outputs, loss
            assert r["log_probs"] <= TOL_VALUE and r["entropy"] <= TOL_VALUE, r
            assert r["loss_rel"] <= TOL_SCALAR_REL, r
            assert r["n_tokens"] == 38 and r["fallback"] == 0.0 and r["train_fallback"] == 0.0
            assert r["dedup_ratio"] > 1.2
        if "grad_norm_rel" in r:
            assert r["grad_norm_rel"] <= TOL_SCALAR_REL, (rank, r)
        print(f"zorro vs stock Megatron engine (fp32) pp2 x vpp2 {case} rank {rank}: "
              + ", ".join(f"{k} {v:.2g}" for k, v in r.items()
                          if isinstance(v, float) and k not in ("fallback", "train_fallback")))
    assert "grad_norm_rel" in bridge_results[0][case] or "grad_norm_rel" in bridge_results[1][case]
    if case == "vpp/fixed4":  # 3 groups of 4 rollouts, 4 rows each: 3 micro-batches rounded up to 4
        assert {r[case]["n_micro_batches"] for r in bridge_results} == {4}


def test_fused_kernels_accepted(bridge_results):
    for r in bridge_results:
        assert r["fused_engine_setting"] is True and r["fused_static_reason"] is None, r


def test_dropout_refused_in_training(vpp_results):
    for r in vpp_results:
        for name in ("hidden_dropout", "attention_dropout"):
            msg = r[f"refused/{name}"]
            assert msg and f"{name}=0.1 in training" in msg and "one dropout mask" in msg, msg
            assert "megatron.zorro.enable=false" in msg
        assert r["forward_only_dropout_reason"] is None
    last = vpp_results[1]  # a forward-only engine runs zorro in eval mode, dropout off: the stock numbers
    assert last["forward_only_dropout_log_probs"] <= TOL_VALUE and last["forward_only_dropout_fallback"] == 0.0


def test_bad_positions_on_one_rank_every_rank_raises(bridge_results):
    """Rank 1 alone gets a row whose positions start at 1: its check runs before the ranks agree, so rank 0 raises
    too (quoting rank 1), instead of rank 1 raising alone inside the pipeline schedule while rank 0 waits."""
    mine, other = bridge_results[1]["positions"], bridge_results[0]["positions"]
    assert mine and "position_ids that do not count 0, 1, 2" in mine, mine
    assert other and "the batch of rank 1 cannot run" in other and "position_ids" in other, other


# ---------------------------------------------------------------------------------------------- model level
@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
    from tests.support import megatron_cpu as M

    warnings.filterwarnings("ignore", message="GPTModel IS DEPRECATED")
    M.init_megatron(0, 1, str(tmp_path_factory.mktemp("rdv") / "init"))
    return M.build_gpt(zorro=True)


@pytest.mark.parametrize("name,value", [("hidden_dropout", 0.1), ("attention_dropout", 0.1),
                                        ("moe_input_jitter_eps", 0.01)])
def test_step_refuses_random_ops_in_training(gpt, name, value):
    from tests.support import megatron_cpu as M
    from zorro_verl.integrations.megatron import zorro_gpt_step
    from zorro_verl.packing import build_plan

    ids, am, R = M.make_batch()
    plan = build_plan(ids, am, R)
    old = getattr(gpt.config, name)
    setattr(gpt.config, name, value)
    try:
        gpt.train()
        with pytest.raises(ValueError, match=f"{name}={value} in training"):
            zorro_gpt_step(gpt, plan)
        gpt.eval()  # evaluation: megatron applies none of them, zorro runs
        lp, _ = zorro_gpt_step(gpt, plan)
        assert lp.numel() == plan.N
    finally:
        setattr(gpt.config, name, old)
        gpt.train()
