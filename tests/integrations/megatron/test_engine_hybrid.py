"""zorro's Megatron engine vs verl 0.9.1's stock Megatron engine on a tiny Qwen3.5 checkpoint (a gated delta-net
layer, then gated full attention), fp32 on the CPU (docs/design/megatron.md "Hybrid models", testing.md).

Built by Megatron-Bridge's ``Qwen35Bridge`` (verl's default builder) on the CPU stand-ins of
tests/support/megatron_gdn.py (megatron's hybrid block spec asserts Transformer Engine; its GDN needs
flash-linear-attention): first checked against transformers' own Qwen3.5 forward on the same checkpoint. The
reference is verl's own engine on its padded path (megatron's ``GatedDeltaNet`` per row, ``DotProductAttention``);
zorro runs each prompt once and every response from its prompt's final recurrent state. One process, TP = 1
(tests/support/megatron_hybrid_engine_ranks.py): fixed micro-batches over two ``train_batch`` steps (log-probs,
entropy, loss, every gradient at both steps, the parameters after each SGD step), then ``sharing=prefix`` with a
dynamic token budget. Tolerances as tests/integrations/megatron/test_engine.py (the second step's gradients at the
fp32 engines' multi-step bound, 1e-5).
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed here (run scripts/test_megatron.sh: "
                                            ".venv-megatron)")

from tests.integrations.megatron.test_engine import (  # noqa: E402
    TOL_GRAD,
    TOL_GRAD_LATER_STEP,
    TOL_PARAM,
    TOL_SCALAR_REL,
    TOL_VALUE,
)

#: the stand-in-built engine vs transformers' Qwen3.5 (fp32; both run their own fp32 kernels)
TOL_HF = 1e-5


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    from tests.support.megatron_bridge_cpu import require_bridge
    from tests.support.multi_rank import run_ranks

    require_bridge()
    tmp = tmp_path_factory.mktemp("megatron_hybrid_engine")
    return run_ranks("tests.support.megatron_hybrid_engine_ranks", 1, [str(tmp / "ckpt")], tmp,
                     timeout_s=int(os.environ.get("ZORRO_MEGATRON_RANK_TIMEOUT", "900")))[0]


def test_model_is_the_bridge_hybrid(result):
    assert result["model"] == {"gdn": 1, "zorro_gdn": 1, "attention": 1, "provider_spec": "gated_delta_net",
                               "engine": "ZorroMegatronEngineWithLMHead"}, result["model"]


def test_standins_equal_transformers(result):
    """The stand-in block spec and kernels, loaded by the bridge, compute transformers' Qwen3.5."""
    r = result["hf"]
    print(f"stock Megatron engine (CPU stand-ins) vs transformers Qwen3.5, fp32: {r}")
    assert r["n"] == 38 and r["log_probs"] <= TOL_HF, r


@pytest.mark.parametrize("case", ["step1", "prefix"])
def test_zorro_engine_equals_stock(result, case):
    r = result[case]
    print(f"zorro vs stock Megatron engine, Qwen3.5 {case}: "
          + ", ".join(f"{k} {v:.2g}" for k, v in r.items() if isinstance(v, float)))
    assert r["n_params"] > 0 and r["grad_rel"] <= TOL_GRAD and r["param_after_step"] <= TOL_PARAM, r
    assert r["log_probs"] <= TOL_VALUE and r["entropy"] <= TOL_VALUE and r["loss_rel"] <= TOL_SCALAR_REL, r
    assert r["n_tokens"] == 38 and r["fallback"] == 0 and r["train_fallback"] == 0 and r["dedup_ratio"] > 1.2, r


def test_second_step(result):
    r = result["step2"]
    print(f"zorro vs stock Megatron engine, Qwen3.5 step 2: {r}")
    assert r["n_params"] == result["step1"]["n_params"]
    assert r["grad_rel"] <= TOL_GRAD_LATER_STEP and r["param_after_step"] <= 2 * TOL_PARAM, r
