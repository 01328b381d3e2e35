"""An HF MoE model with its router load-balancing loss turned on (``output_router_logits=True``,
``router_aux_loss_coef > 0``) under the zorro step, fp64 (docs/design/verl.md, MoE on the FSDP engine).

The HF model adds that loss to ``output.loss`` only when it is given ``labels``; verl's FSDP engines call it without
labels and never read ``output.aux_loss`` (their loss is computed from the log-probs), and neither does the zorro
step, which returns log-probs / entropy only. So the setting changes no number of training on either side: zorro vs
the ordinary per-row forward with the same setting, log-probs, entropy, loss and every gradient (tolerances of
test_step.py). The OpenRLHF actor, whose loss does read ``output.aux_loss``, refuses it by name
(tests/integrations/openrlhf).
"""

import torch

from tests.integrations.transformers.test_step import assert_equal, batch_of, run_pair
from zorro_verl.testing import tiny_model


def _router_loss_on(kind, **kwargs):
    model = tiny_model(kind, **kwargs)
    model.config.output_router_logits = True
    model.config.router_aux_loss_coef = 0.5
    return model


def test_router_aux_loss_on_changes_nothing_zorro_returns():
    model = _router_loss_on("qwen3_moe")
    ids = torch.randint(1, 128, (2, 5), generator=torch.Generator().manual_seed(0))
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids))
    assert out.aux_loss is not None and out.aux_loss.item() > 0 and out.loss is None  # the setting is on
    r = run_pair("qwen3_moe", batch=batch_of(seed=11), make=_router_loss_on)
    assert r["plan"].T < r["plan"].ordinary_tokens
    assert_equal(r)
