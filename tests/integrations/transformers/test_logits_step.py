"""zorro's logits step (zorro_logits: the whole distribution at the response-predicting rows, for verl's top-k
distillation loss) vs the ordinary per-row forward, fp64.

Compared: the logits at the positions verl reads (the last prompt token and every response token but the last), a
top-k distillation loss over them (forward KL to fixed teacher top-k log-probs, as verl's ``compute_forward_kl_topk``)
and EVERY parameter gradient. Tolerance (docs/design/testing.md): logits / loss max abs <= 1e-11, gradients per-tensor
relative <= 1e-9.
"""

import pytest
import torch

from zorro_verl.integrations.transformers import install_zorro, zorro_logits
from zorro_verl.packing import build_plan
from zorro_verl.testing import create_dummy_batch, grads_of, max_rel_grad_error, tiny_model

ABS_TOL = 1e-11
REL_TOL = 1e-9
K = 4


def _topk_kl(logits, t_ids, t_logp, mask):
    """Forward KL on the teacher's top-k (verl's formula): ``sum_k p_t (log p_t - log q_s)`` per token, masked mean.
    ``logits [B, R, V]``, ``t_ids`` / ``t_logp [B, R, K]``, ``mask [B, R]``."""
    s = torch.log_softmax(logits, -1).gather(-1, t_ids)
    kl = (t_logp.exp() * (t_logp - s)).sum(-1)
    m = mask.to(kl.dtype)
    return (kl * m).sum() / m.sum()


@pytest.mark.parametrize("sharing", ["prompt", "prefix"])
def test_logits_and_topk_loss_gradients_equal_ordinary(sharing):
    batch = create_dummy_batch(8, 3, 12, 6, device="cpu", add_padding=True, shuffle=True, vocab_size=128, seed=1)
    R = batch["responses"].shape[1]
    P = batch["input_ids"].shape[1] - R
    ref, z = tiny_model(seed=3), tiny_model(seed=3)
    install_zorro(z)
    ref.train()
    z.train()
    gen = torch.Generator().manual_seed(5)
    t_logp, t_ids = torch.log_softmax(torch.randn(8, R, 128, generator=gen, dtype=torch.float64), -1).topk(K, -1)
    mask = batch["response_mask"].bool()

    lg_ref = ref(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                 position_ids=batch["position_ids"], use_cache=False).logits[:, P - 1: P - 1 + R]  # [B, R, V]
    _topk_kl(lg_ref, t_ids, t_logp, mask).backward()

    kw = {"sharing": "prefix", "min_shared_len": 1} if sharing == "prefix" else {}
    plan = build_plan(batch["input_ids"], batch["attention_mask"], R, position_ids=batch["position_ids"], **kw)
    lg = zorro_logits(z, plan)  # [N, V]
    assert lg.dtype == torch.float64 and lg.shape == (int(mask.sum()), 128)
    # the plan's outputs are the valid response tokens; their targets are the tokens the rows' logits predict
    assert torch.equal(plan.target_ids, batch["responses"][plan.out_row, plan.out_col])
    lg_pad = lg.new_zeros(8, R, 128).index_put((plan.out_row, plan.out_col), lg)
    loss = _topk_kl(lg_pad, t_ids, t_logp, mask)
    loss.backward()
    assert lg_ref[mask].abs().max() > 0.1
    assert (lg_pad - lg_ref)[mask].abs().max().item() <= ABS_TOL
    assert abs(loss.item() - _topk_kl(lg_ref.detach(), t_ids, t_logp, mask).item()) <= ABS_TOL
    err, name = max_rel_grad_error(grads_of(ref), grads_of(z))
    assert err <= REL_TOL, (name, err)
