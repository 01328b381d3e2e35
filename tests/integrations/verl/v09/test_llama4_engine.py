"""Llama 4 text (``Llama4ForCausalLM``: three ``chunked_attention`` RoPE layers with chunk 4 and a NoPE
``full_attention`` layer with its query temperature, every layer a mixture of experts) through the verl 0.9 zorro
engine vs the stock engine on the same fp32 weights: inference (log-probs, entropy) and one PPO training step.

Same tolerances as test_engine.py (fp32): log-probs / entropy max abs <= 1e-5; loss, grad norm and every gradient
relative <= 1e-5. The chunk (4) cuts inside every prompt (9 tokens) and response (5): the stock engine runs padded
(``use_remove_padding=False``; its chunked mask accounts for the left padding) with transformers' SDPA path, zorro its
``sdpa`` backend. ``floor_scale`` is the real models' 8192: the stock padded path computes the NoPE temperature from
the padded index (the same packed/padded-index reading zorro fixes), which at 8192 is 1 for every token here, so
the stock engine is a valid reference; the temperature's exactness at a small ``floor_scale`` is tested in fp64
against the per-row forward (tests/integrations/transformers/test_llama4.py).
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


def test_llama4_infer_and_train_match_stock(llama4_ckpt):
    from tests.support.verl_engines import assert_matches_stock, padded_stock_vs_zorro

    r = padded_stock_vs_zorro(llama4_ckpt, attn_implementation="sdpa")
    assert_matches_stock(r, ATOL, RTOL)
    assert any("experts" in name for name in r["grad_names"])
    (loss_a, loss_b), (gn_a, gn_b) = r["loss"], r["grad_norm"]
    print(f"Llama 4 verl engine vs stock: log-prob {r['log_probs']:.2e}, entropy {r['entropy']:.2e}, loss "
          f"{abs(loss_a - loss_b) / abs(loss_a):.2e} rel, grad norm {abs(gn_a - gn_b) / gn_a:.2e} rel, grads "
          f"{r['grad_rel']:.2e} rel")


def test_flash_backend_refuses_rows_past_the_chunk_per_batch(llama4_ckpt):
    """``flash_copyfree`` (what ``auto`` picks; it runs on CPU) cannot express a chunk boundary: a batch whose rows
    pass the chunk (4) is refused before any forward — ``raise`` names it, ``warn`` runs the stock forward for it
    (counted) and matches the stock engine."""
    from tests.support.verl_engines import build_engine, infer, make_engine_batch, output_values

    td = make_engine_batch(batch_size=4, num_prompts=2, prompt_len=6, response_len=3, seed=1)
    z = build_engine(llama4_ckpt, zorro=True, zorro_settings={"attention_backend": "flash_copyfree"})
    with pytest.raises(ValueError, match=r"attention_chunk_size=4\) with rows up to \d+ tokens on "
                                         r"attention_backend='flash_copyfree', which cannot express a chunk boundary"):
        infer(z, td.clone())
    warn = build_engine(llama4_ckpt, zorro=True,
                        zorro_settings={"attention_backend": "flash_copyfree", "on_unsupported": "warn"})
    out = infer(warn, td.clone())
    assert out["metrics"]["zorro/fallback_batches"] == [1.0]
    ref = infer(build_engine(llama4_ckpt, zorro=False), td.clone())
    mask = td["response_mask"].bool()
    assert (output_values(ref, td, "log_probs") - output_values(out, td, "log_probs"))[mask].abs().max().item() <= ATOL
