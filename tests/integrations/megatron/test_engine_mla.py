"""zorro's Megatron engine vs verl 0.9.1's stock Megatron engine on a tiny DeepSeek-V3 checkpoint (multi-latent
attention + MoE), fp32 on the CPU (docs/design/megatron.md, testing.md).

The checkpoint (tests/support/megatron_deepseek.py): MLA with compressed q / kv, q / k heads of 16 + 8 (decoupled
RoPE) and v heads of 12; the first layer dense, the second a top-2-of-4 sigmoid-routed MoE with a shared expert;
built by each of verl's model builders in turn — Megatron-Bridge's ``DeepSeekV3Bridge`` (verl's default; its decoder
block on megatron's local modules, tests/support/megatron_bridge_cpu.py B1) and vanilla mbridge's
``DeepseekV3Bridge`` (its CPU adaptations in megatron_deepseek.py) —, with the expert-bias updates and
the auxiliary loss off (statistics over the micro-batch's tokens, which zorro weighs by multiplicity: compared in
tests/integrations/megatron/test_moe.py). The reference is verl's own engine
on its padded path (megatron's ``DotProductAttention``), as tests/integrations/megatron/test_engine.py, with its
tolerances: TP = 2 + sequence parallelism in one 2-process gloo group (tests/support/megatron_mla_engine_ranks.py),
fixed micro-batch size, a dynamic token budget and ``sharing=prefix``.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed here (run scripts/test_megatron.sh: "
                                            ".venv-megatron)")

from tests.integrations.megatron.test_engine import (  # noqa: E402
    BRIDGES,
    TOL_GRAD,
    TOL_PARAM,
    TOL_SCALAR_REL,
    TOL_VALUE,
)
from tests.support.megatron_bridge_cpu import results_on  # noqa: E402


@pytest.fixture(scope="module")
def all_results(tmp_path_factory):
    from tests.support.multi_rank import run_ranks

    tmp = tmp_path_factory.mktemp("megatron_mla_engine")
    return run_ranks("tests.support.megatron_mla_engine_ranks", 2, [str(tmp / "ckpt")], tmp,
                     timeout_s=int(os.environ.get("ZORRO_MEGATRON_RANK_TIMEOUT", "900")))


@pytest.fixture(params=BRIDGES)
def engine_results(all_results, request):
    """Each rank's results on one model builder (Megatron-Bridge required where scripts/test_megatron.sh runs)."""
    bridge = request.param
    return results_on(all_results, bridge)


def test_model_is_deepseek_v3_shaped(engine_results, request):
    """MLA in both layers, the second MoE, its router loaded from the checkpoint. Megatron-Bridge builds MLA's RoPE as
    YaRN with scaling factor 1 and mscale 1 (the checkpoint has no rope scaling; megatron's MLA default would be
    DeepSeek-V3's factor 40), mbridge as plain RoPE: zorro's MLA runs both tables."""
    vanilla = request.node.callspec.params["engine_results"] == "mbridge"
    for rank, res in enumerate(engine_results):
        assert res["model"] == {"mla_layers": 2, "moe_layers": 1, "rope_type": "rope" if vanilla else "yarn",
                                "tp": 2, "sp": True,
                                "zorro": "ZorroMegatronEngineWithLMHead", "vanilla": vanilla,
                                "router_from_checkpoint": True}, (rank, res["model"])


@pytest.mark.parametrize("case", ["fixed", "dynamic", "prefix"])
def test_zorro_engine_equals_stock(engine_results, case):
    for rank, per in enumerate(engine_results):
        r = per[case]
        assert r["n_params"] > 0 and r["grad_rel"] <= TOL_GRAD, (rank, r)
        assert r["param_after_step"] <= TOL_PARAM, (rank, r)
        assert r["dedup_ratio"] > 1.0 and r["fallback"] == 0 and r["train_fallback"] == 0, (rank, r)
        assert r["n_tokens"] == 38
        assert r["log_probs"] <= TOL_VALUE and r["entropy"] <= TOL_VALUE, (rank, r)
        assert r["loss_rel"] <= TOL_SCALAR_REL, (rank, r)
        if "grad_norm_rel" in r:
            assert r["grad_norm_rel"] <= TOL_SCALAR_REL, (rank, r)
        print(f"zorro vs stock Megatron engine, DeepSeek-V3 (tp2+sp) {case} rank {rank}: "
              + ", ".join(f"{k} {v:.2g}" for k, v in r.items()
                          if isinstance(v, float) and k not in ("fallback", "train_fallback")))
    assert any("grad_norm_rel" in per[case] for per in engine_results)
