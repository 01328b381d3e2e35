"""zorro's value step (zorro_values) vs the ordinary per-row forward of a value model (verl's critic:
``*ForTokenClassification``, num_labels=1), fp64.

Compared: the values at the positions verl reads (the last prompt token and every response token but the last, in
verl's ``[B, R]`` layout), a value loss over them and EVERY parameter gradient. Tolerance (docs/design/testing.md):
values / loss max abs <= 1e-12-ish (1e-11), gradients per-tensor relative <= 1e-9.
"""

import pytest
import torch

from zorro_verl.integrations.transformers import install_zorro, zorro_values
from zorro_verl.packing import build_plan
from zorro_verl.testing import create_dummy_batch, grads_of, max_rel_grad_error, tiny_value_model

ABS_TOL = 1e-11
REL_TOL = 1e-9


def _ordinary_values(model, batch, R):
    """verl's reading of a value model on the padded batch: ``logits[:, P - 1 + j, 0]`` predicts response column ``j``
    (``[B, R]``, rows run separately through their own attention mask)."""
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                position_ids=batch["position_ids"], use_cache=False).logits[..., 0]
    P = batch["input_ids"].shape[1] - R
    return out[:, P - 1: P - 1 + R]


def _loss(v, batch):
    """A value loss over response tokens (squared error to fixed returns), so every gradient is compared."""
    m = batch["response_mask"].to(v.dtype)
    returns = batch["advantages"].to(v.dtype)
    return (((v - returns) ** 2) * m).sum() / m.sum()


@pytest.mark.parametrize("sharing", ["prompt", "prefix"])
def test_values_and_gradients_equal_ordinary(sharing):
    batch = create_dummy_batch(8, 3, 12, 6, device="cpu", include_training_fields=True, add_padding=True,
                               shuffle=True, vocab_size=128, seed=1)
    R = batch["responses"].shape[1]
    ref, z = tiny_value_model(seed=3), tiny_value_model(seed=3)
    install_zorro(z)
    ref.train()
    z.train()
    v_ref = _ordinary_values(ref, batch, R)
    _loss(v_ref, batch).backward()
    kw = {"sharing": "prefix", "min_shared_len": 1} if sharing == "prefix" else {}
    plan = build_plan(batch["input_ids"], batch["attention_mask"], R, position_ids=batch["position_ids"], **kw)
    v = plan.to_padded(zorro_values(z, plan))
    loss = _loss(v, batch)
    loss.backward()
    m = batch["response_mask"].bool()
    assert v.dtype == torch.float64 and v_ref[m].abs().max() > 0.1
    assert (v - v_ref)[m].abs().max().item() <= ABS_TOL
    assert abs(loss.item() - _loss(v_ref.detach(), batch).item()) <= ABS_TOL
    err, name = max_rel_grad_error(grads_of(ref), grads_of(z))
    assert err <= REL_TOL, (name, err)
    assert "score.weight" in grads_of(z)


def test_value_head_refusals():
    from transformers import AutoModelForCausalLM

    from zorro_verl.testing import tiny_model

    lm = tiny_model()
    assert isinstance(lm, AutoModelForCausalLM._model_mapping[type(lm.config)])
    install_zorro(lm)
    plan = build_plan(torch.tensor([[1, 2, 3, 4]]), torch.ones(1, 4, dtype=torch.long), 2)
    with pytest.raises(ValueError, match=r"expected a \*ForTokenClassification model with num_labels=1"):
        zorro_values(lm, plan)
    vm = tiny_value_model()
    vm.v_head = torch.nn.Linear(vm.config.hidden_size, 1)  # what trl's value-head wrapper carries
    with pytest.raises(ValueError, match="a trl AutoModelForCausalLMWithValueHead"):
        zorro_values(vm, plan)
    del vm.v_head
    vm.dropout.p = 0.1
    vm.train()
    install_zorro(vm)
    with pytest.raises(ValueError, match="classifier dropout is 0.1 in training mode"):
        zorro_values(vm, plan)
