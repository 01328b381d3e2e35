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
    from tests.support.verl_engines import build_engine, engine_grads, make_engine_batch, ppo_loss_fn, response_values
    from zorro_verl.testing import grad_rel_error

    batches = [make_engine_batch(batch_size=8, num_prompts=2, prompt_len=9, response_len=5, seed=5, shuffle=True,
                                 temperature=0.8, calculate_entropy=True, micro_batch_size=4, use_remove_padding=z)
               for z in (False, True)]
    mask = batches[1]["response_mask"].bool()
    infer, train, grads = [], [], []
    for z, td in zip((False, True), batches):
        eng = build_engine(gpt_oss_ckpt, zorro=z, micro_batch_size=4, use_remove_padding=z,
                           attn_implementation="eager")
        with eng.eval_mode():
            infer.append(eng.infer_batch(td.clone(), loss_function=None))
        with eng.train_mode(zero_grad_on_exit=False):
            train.append(eng.train_batch(td.clone(), loss_function=ppo_loss_fn()))
        grads.append(engine_grads(eng))
    errs = {}
    for key in ("log_probs", "entropy"):
        a, b = (response_values(o["model_output"][key], t) for o, t in zip(infer, batches))
        assert a[mask].abs().max() > 0.1
        errs[key] = (a - b)[mask].abs().max().item()
        assert errs[key] <= ATOL, key
    assert infer[1]["metrics"]["zorro/dedup_ratio"][0] > 1.0
    loss_a, loss_b = sum(train[0]["loss"]), sum(train[1]["loss"])
    gn_a, gn_b = float(train[0]["metrics"]["grad_norm"]), float(train[1]["metrics"]["grad_norm"])
    assert abs(loss_a) > 1e-4 and gn_a > 1e-4
    assert abs(loss_a - loss_b) <= RTOL * abs(loss_a)
    assert abs(gn_a - gn_b) <= RTOL * gn_a
    assert any("sinks" in name for name in grads[1]) and grad_rel_error(grads[0], grads[1]) <= RTOL
    print(f"gpt-oss verl engine vs stock: log-prob {errs['log_probs']:.2e}, entropy {errs['entropy']:.2e}, loss "
          f"{abs(loss_a - loss_b) / abs(loss_a):.2e} rel, grad norm {abs(gn_a - gn_b) / gn_a:.2e} rel, grads "
          f"{grad_rel_error(grads[0], grads[1]):.2e} rel")
