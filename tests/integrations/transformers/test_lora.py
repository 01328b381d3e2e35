"""LoRA (PEFT): zorro_step on a ``PeftModel`` vs the ordinary per-row forward of an identical one, tiny Qwen3, fp64.

The adapter (tests/support/lora.py: rank 8, ``lora_B`` drawn at random so that it changes the outputs and
``lora_A`` gets gradients) sits on every linear layer but the head, or on a subset of projections, or on the head
too. Compared as tests/integrations/transformers/test_step.py does (log-probs, entropy, the PPO loss and every
gradient, which here is every LoRA parameter's: the base weights are frozen), per logits mode, with gradient
checkpointing and with a prefix-tree plan; the adapter disabled gives the base model's values; dropout is refused.
Tolerance (docs/design/testing.md): 1e-9.
"""

import pytest
import torch

from tests.integrations.transformers.test_step import REL_TOL, assert_equal, batch_of, run_pair
from tests.support.lora import LORA_TARGETS, wrap_lora
from zorro_verl.integrations.transformers import install_zorro, zorro_step
from zorro_verl.packing import build_plan
from zorro_verl.testing import ordinary_logprobs, tiny_model


def _lora_model(targets):
    def make(kind, **kw):
        return wrap_lora(tiny_model(kind, **kw), targets, seed=5)
    return make


@pytest.mark.parametrize("mode", ["none", "compute", "memory"])
@pytest.mark.parametrize("target", list(LORA_TARGETS))
def test_lora_step_matches_ordinary(target, mode):
    r = run_pair(mode=mode, batch=batch_of(seed=2), make=_lora_model(LORA_TARGETS[target]))
    assert_equal(r)
    p = r["plan"]
    assert p.G < p.B  # prompts shared


def test_lora_with_gradient_checkpointing_and_the_head_adapted():
    """Checkpointing recomputes each layer with the zorro kwarg; a LoRA head is exact in the logits mode that calls
    the head module (the memory mode refuses a non-Linear head: tests/integrations/verl/v09/test_lora.py)."""
    assert_equal(run_pair(checkpointing=True, batch=batch_of(seed=3), make=_lora_model("all-linear")))
    assert_equal(run_pair(mode="compute", batch=batch_of(seed=4), make=_lora_model(["q_proj", "lm_head"])))


def test_lora_prefix_tree_and_disabled_adapter():
    """A prefix-tree plan (a shared system prompt over several questions) on the LoRA model, and the same model
    under ``disable_adapter()`` (a LoRA run's reference) equal to the base model it wraps."""
    from zorro_verl.testing import batch_from_rows, shared_system_rows

    rows = shared_system_rows(3, 3, system_len=10, question_len=3, response_len=4, vocab_size=128, seed=1)
    b = batch_from_rows(rows, include_training_fields=True, seed=2)
    R = b["responses"].shape[1]
    base = tiny_model("qwen3")
    ordinary = wrap_lora(tiny_model("qwen3"), seed=5)  # the same adapter on an identical copy, zorro not installed
    model = wrap_lora(tiny_model("qwen3"), seed=5)
    install_zorro(model)
    plan = build_plan(b["input_ids"], b["attention_mask"], R, sharing="prefix", min_shared_len=4)
    assert plan.tree is not None
    with torch.no_grad():
        lp, _ = zorro_step(model, plan)
        ref, _ = ordinary_logprobs(ordinary, b["input_ids"], b["attention_mask"], R)
        assert (lp - ref).abs().max().item() <= REL_TOL
        with model.disable_adapter():
            lp_off, _ = zorro_step(model, plan)
        lp_base, _ = ordinary_logprobs(base, b["input_ids"], b["attention_mask"], R)
    assert (lp_off - lp_base).abs().max().item() <= REL_TOL
    assert (lp - lp_off).abs().max().item() > 1e-3  # the adapter matters


def test_lora_dropout_refused_at_install():
    model = wrap_lora(tiny_model("qwen3"), dropout=0.05)
    with pytest.raises(ValueError, match=r"LoRA dropout > 0 \(adapter 'default' of .*p=0.05"):
        install_zorro(model)
    install_zorro(wrap_lora(tiny_model("qwen3"), dropout=0.0))  # no dropout: installs


def test_activated_lora_refused_at_install():
    """aLoRA (``alora_invocation_tokens``): PEFT finds the invocation in each input row and adapts the tokens after
    it; zorro's one packed row holds several groups, so it would find one invocation only (the other groups'
    responses silently without the adapter): refused by name."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_model("qwen3"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                           alora_invocation_tokens=[5, 6], task_type="CAUSAL_LM"))
    with pytest.raises(ValueError, match=r"activated LoRA \(aLoRA: adapter 'default' has alora_invocation_tokens\)"):
        install_zorro(model)
