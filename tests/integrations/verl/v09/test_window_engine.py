"""A sliding-window + attention-sink family (gpt-oss: alternating sliding / full layers, per-head sinks, MoE)
through the verl 0.9 zorro engine vs the stock engine on the same fp32 weights.

Same tolerances as test_engine.py (fp32): log-probs / entropy max abs <= 1e-5; loss, grad norm and every gradient
relative <= 1e-5. gpt-oss has no SDPA path: the stock engine runs transformers' eager attention (whose softmax keeps
the fp32 dtype and whose mask applies each sliding layer's window). The stock reference runs padded
(``use_remove_padding=False``): on CPU, verl's remove-padding path hands eager attention one packed row whose
sequence boundaries only flash kernels read from the position ids.
"""

import pytest
import torch

pytestmark = pytest.mark.usefixtures("verl_cpu")

ATOL = 1e-5
RTOL = 1e-5


@pytest.fixture(scope="module")
def gpt_oss_ckpt(verl_cpu, tmp_path_factory):
    from zorro_verl.testing import tiny_window_model

    path = tmp_path_factory.mktemp("tiny_gpt_oss")
    model = tiny_window_model("gpt_oss", dtype=torch.float32, seed=0, exact=False, window=4)
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(path)
    return str(path)


def test_gpt_oss_infer_and_train_match_stock(gpt_oss_ckpt):
    from tests.support.verl_engines import assert_matches_stock, padded_stock_vs_zorro

    r = padded_stock_vs_zorro(gpt_oss_ckpt, attn_implementation="eager")
    assert_matches_stock(r, ATOL, RTOL)
    assert any("sinks" in name for name in r["grad_names"])
    (loss_a, loss_b), (gn_a, gn_b) = r["loss"], r["grad_norm"]
    print(f"gpt-oss verl engine vs stock: log-prob {r['log_probs']:.2e}, entropy {r['entropy']:.2e}, loss "
          f"{abs(loss_a - loss_b) / abs(loss_a):.2e} rel, grad norm {abs(gn_a - gn_b) / gn_a:.2e} rel, grads "
          f"{r['grad_rel']:.2e} rel")
