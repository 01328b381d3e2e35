"""Hybrid linear-attention models (Qwen3.5, Qwen3-Next) through the verl 0.9 zorro engine vs the stock engine.

Same tolerances as test_engine.py (fp32): log-probs / entropy max abs <= 1e-5; loss and grad norm rel <= 1e-5.

The reference is the stock engine with ``use_remove_padding=False``: with remove-padding verl packs the rows into
one sequence, and transformers' CPU (torch) gated delta-net has no sequence boundaries, so the stock result leaks
recurrent state from one row into the next (measured here: 4e-3 log-prob differences). zorro runs each response
from its own prompt's state whatever ``use_remove_padding`` says, so it is checked with the default (True).
"""

import pytest
import torch

pytestmark = pytest.mark.usefixtures("verl_cpu")

ATOL = 1e-5
RTOL = 1e-5


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next"])
def hybrid_ckpt(request, verl_cpu, tmp_path_factory):
    from zorro_verl.testing import tiny_hybrid_model

    path = tmp_path_factory.mktemp(f"tiny_{request.param}")
    model = tiny_hybrid_model(request.param, dtype=torch.float32, seed=0, exact=False)
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(path)
    return str(path)


def test_hybrid_infer_and_train_match_stock(hybrid_ckpt):
    from tests.support.verl_engines import build_engine, engine_grads, make_engine_batch, ppo_loss_fn, response_values
    from zorro_verl.testing import grad_rel_error

    batches = [make_engine_batch(batch_size=8, num_prompts=2, prompt_len=9, response_len=5, seed=5, shuffle=True,
                                 temperature=0.8, calculate_entropy=True, micro_batch_size=4, use_remove_padding=z)
               for z in (False, True)]
    mask = batches[1]["response_mask"].bool()  # the same in both batches
    infer, train, grads = [], [], []
    for z, td in zip((False, True), batches):
        eng = build_engine(hybrid_ckpt, zorro=z, micro_batch_size=4, use_remove_padding=z)
        with eng.eval_mode():
            infer.append(eng.infer_batch(td.clone(), loss_function=None))
        with eng.train_mode(zero_grad_on_exit=False):
            train.append(eng.train_batch(td.clone(), loss_function=ppo_loss_fn()))
        grads.append(engine_grads(eng))
    for key in ("log_probs", "entropy"):
        a, b = (response_values(o["model_output"][key], t) for o, t in zip(infer, batches))
        assert a[mask].abs().max() > 0.1
        assert (a - b)[mask].abs().max().item() <= ATOL, key
    assert infer[1]["metrics"]["zorro/dedup_ratio"][0] > 1.0
    loss_a, loss_b = sum(train[0]["loss"]), sum(train[1]["loss"])
    gn_a, gn_b = float(train[0]["metrics"]["grad_norm"]), float(train[1]["metrics"]["grad_norm"])
    assert abs(loss_a) > 1e-4 and gn_a > 1e-4
    assert abs(loss_a - loss_b) <= RTOL * abs(loss_a)
    assert abs(gn_a - gn_b) <= RTOL * gn_a
    assert grad_rel_error(grads[0], grads[1]) <= RTOL
