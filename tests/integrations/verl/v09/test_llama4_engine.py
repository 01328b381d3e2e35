"""Llama 4 text (``Llama4ForCausalLM``: three ``chunked_attention`` RoPE layers with chunk 4 and a NoPE
``full_attention`` layer with its query temperature, every layer a mixture of experts) through the verl 0.9 zorro
engine vs the stock engine on the same fp32 weights: inference (log-probs, entropy) and one PPO training step.

Same tolerances as test_engine.py (fp32): log-probs / entropy max abs <= 1e-5; loss, grad norm and every gradient
relative <= 1e-5. The chunk (4) cuts inside every prompt (9 tokens) and response (5): the stock engine runs padded
(``use_remove_padding=False``; its chunked mask accounts for the left padding) with transformers' SDPA path, zorro its
``sdpa`` and its ``flash_copyfree`` backend (what ``auto`` picks). ``floor_scale`` is the real models' 8192: the
stock padded path computes the NoPE temperature from the padded index (the same index reading zorro fixes), which at
8192 is 1 for every token here, so the stock engine is a valid reference; the temperature's exactness at a small
``floor_scale`` is tested in fp64 against the per-row forward (tests/integrations/transformers/test_llama4.py).
"""

import pytest
import torch

pytestmark = pytest.mark.usefixtures("verl_cpu")

ATOL = 1e-5
RTOL = 1e-5


@pytest.fixture(scope="module")
def llama4_ckpt(verl_cpu, tmp_path_factory):
    from zorro_verl.testing import tiny_llama4_model

    path = tmp_path_factory.mktemp("tiny_llama4")
    model = tiny_llama4_model(dtype=torch.float32, seed=0, chunk=4, floor_scale=8192)
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("backend", ["sdpa", "flash_copyfree"])
def test_llama4_infer_and_train_match_stock(llama4_ckpt, backend):
    """``flash_copyfree`` is what ``attention_backend: auto`` picks (on CPU its CPU flash kernels): chunked layers run
    the flash design's chunk pieces."""
    from tests.support.verl_engines import assert_matches_stock, padded_stock_vs_zorro

    r = padded_stock_vs_zorro(llama4_ckpt, attn_implementation="sdpa", zorro_settings={"attention_backend": backend})
    assert_matches_stock(r, ATOL, RTOL)
    assert any("experts" in name for name in r["grad_names"])
    (loss_a, loss_b), (gn_a, gn_b) = r["loss"], r["grad_norm"]
    print(f"Llama 4 verl engine ({backend}) vs stock: log-prob {r['log_probs']:.2e}, entropy {r['entropy']:.2e}, "
          f"loss {abs(loss_a - loss_b) / abs(loss_a):.2e} rel, grad norm {abs(gn_a - gn_b) / gn_a:.2e} rel, grads "
          f"{r['grad_rel']:.2e} rel")
