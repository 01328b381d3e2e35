"""Qwen2.5-VL through zorro's Megatron engine (docs/design/megatron.md "Vision-language models", testing.md).

A tiny ``Qwen2_5_VLForConditionalGeneration`` checkpoint (tests/support/megatron_vlm.py) built by Megatron-Bridge's
``Qwen25VLBridge`` (verl's default builder: a ``Qwen25VLModel``, transformers' vision tower beside megatron's
``GPTModel`` with 3-D mrope positions) on the bridge's local layer spec; batches of 4 prompts x 3 rollouts: two
prompts with the same tokens and different pixels, one with two images of different sizes, one text-only. One process,
TP = 1 (tests/support/megatron_vlm_engine_ranks.py):

* the stock engine on the CPU stand-ins vs transformers' own Qwen2.5-VL on the same checkpoint (fp32);
* fp32 engines: verl's stock Megatron engine (padded bshd path, the model computing its own positions) vs zorro's
  over two ``train_batch`` SGD steps (log-probs, entropy, loss, every gradient incl. the vision tower's, the
  parameters after each step), then ``sharing=prefix`` with a dynamic budget; the images the vision tower encodes;
* fp64 model level: zorro's step on the packed row vs the model's own forward on each row.

Tolerances: the fp32 ones of tests/integrations/megatron/test_engine.py; fp64 1e-12.
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

#: the bridge-built engine vs transformers' Qwen2.5-VL (fp32; both run their own fp32 kernels)
TOL_HF = 1e-5
#: fp64: zorro's step vs the model's own forward per row (log-probs / entropy abs, gradients max|d| / max|ref|)
TOL_FP64 = 1e-12
#: response tokens of the batch (12 rows, one empty response)
N_TOKENS = 36


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    from tests.support.megatron_bridge_cpu import require_bridge
    from tests.support.multi_rank import run_ranks

    require_bridge()
    tmp = tmp_path_factory.mktemp("megatron_vlm_engine")
    return run_ranks("tests.support.megatron_vlm_engine_ranks", 1, [str(tmp / "ckpt")], tmp,
                     timeout_s=int(os.environ.get("ZORRO_MEGATRON_RANK_TIMEOUT", "900")))[0]


def test_model_is_the_bridge_qwen25_vl(result):
    assert result["model"] == {"class": "Qwen25VLModel", "zorro_class": "Qwen25VLModel",
                               "position_embedding": "mrope", "zorro_attention": 2, "vision_params": 30,
                               "engine": "ZorroMegatronEngineWithLMHead"}, result["model"]


def test_standins_equal_transformers(result):
    """The bridge-built model through verl's stock engine computes transformers' Qwen2.5-VL."""
    r = result["hf"]
    print(f"stock Megatron engine (CPU stand-ins) vs transformers Qwen2.5-VL, fp32: {r}")
    assert r["n"] == N_TOKENS and r["log_probs"] <= TOL_HF, r


@pytest.mark.parametrize("case", ["step1", "prefix"])
def test_zorro_engine_equals_stock(result, case):
    r = result[case]
    print(f"zorro vs stock Megatron engine, Qwen2.5-VL {case}: "
          + ", ".join(f"{k} {v:.2g}" for k, v in r.items() if isinstance(v, float)))
    assert r["n_params"] == 47 and r["grad_rel"] <= TOL_GRAD and r["param_after_step"] <= TOL_PARAM, r
    assert r["log_probs"] <= TOL_VALUE and r["entropy"] <= TOL_VALUE and r["loss_rel"] <= TOL_SCALAR_REL, r
    assert r["n_tokens"] == N_TOKENS and r["fallback"] == 0 and r["train_fallback"] == 0 and r["dedup_ratio"] > 2, r


def test_second_step(result):
    r = result["step2"]
    print(f"zorro vs stock Megatron engine, Qwen2.5-VL step 2: {r}")
    assert r["n_params"] == result["step1"]["n_params"]
    assert r["grad_rel"] <= TOL_GRAD_LATER_STEP and r["param_after_step"] <= 2 * TOL_PARAM, r


def test_vision_tower_encodes_each_unique_image_once(result):
    """Step 1 (one infer_batch + one train_batch): stock encodes every row's images (12 per pass), zorro each
    unique prompt's (4 per pass: prompts 0 and 1 share tokens, not pixels)."""
    assert result["images"] == {"stock": 24, "zorro": 8}, result["images"]


def test_fp64_step_equals_ordinary_forward(result):
    r = result["fp64"]
    print(f"zorro's Megatron step vs Qwen25VLModel's own forward per row, fp64: {r}")
    assert r["dtype"] == "torch.float64" and r["n_tokens"] == N_TOKENS and r["dedup_ratio"] > 2, r
    assert r["log_probs"] <= TOL_FP64 and r["entropy"] <= TOL_FP64, r
    assert r["n_params"] == 47 and r["grad_rel"] <= TOL_FP64, r
    assert r["n_vision_params"] == 30 and r["vision_grad_rel"] <= TOL_FP64 and r["vision_grad_max"] > 0.1, r
    assert r["images_ref"] == 12 and r["images_zorro"] == 4, r
