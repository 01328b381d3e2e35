"""Every causal-LM architecture of the pinned transformers (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``) against the one
outcome table, ``zorro_verl.testing.families.OUTCOMES``, both ways:

* ``exact``: a tiny fp64 model of the family (2 layers, hidden 32, vocab 128; hybrids one layer of each type)
  through ``install_zorro`` + ``build_plan`` + ``zorro_step`` on one short GRPO batch equals the family's own
  forward of each row alone (eager attention): log-probs, entropy and loss <= 1e-9 abs, every parameter gradient
  <= 1e-8 relative. Both sides run under ``KeepFp64`` (the family's fp32 upcasts kept in fp64, so the comparison
  measures zorro, not fp32 rounding; docs/design/testing.md).
* ``refused:<key>``: install or the step raises ``ValueError`` carrying the phrase of that record of
  ``zorro_verl/refusals.py`` (the message docs/refusals.md lists).
* ``skipped:<reason>``: not built here; the reason is the skip message (``pytest -rs`` prints the table).

A family whose reality differs from its entry fails, naming both. The table also lists exactly the architectures the
pinned transformers has, and docs/families.md is generated from it.
"""

from pathlib import Path

import pytest
import torch

from tests.integrations.transformers.test_step import _loss, batch_of
from zorro_verl.integrations.transformers import install_zorro, zorro_step
from zorro_verl.packing import build_plan
from zorro_verl.refusals import REFUSALS
from zorro_verl.testing import grads_of, max_rel_grad_error, ordinary_logprobs
from zorro_verl.testing.families import OUTCOMES, SLOW, counts, markdown, tiny_family_model
from zorro_verl.testing.fp64 import KeepFp64

ABS_TOL = 1e-9
GRAD_REL_TOL = 1e-8
#: A gradient that is zero in exact arithmetic (a key bias: softmax ignores a shift of every score) is rounding
#: noise; each tensor's error is measured against at least this fraction of the largest gradient.
GRAD_FLOOR = 1e-6
PHRASES = {r.key: r.phrase for r in REFUSALS}
ROOT = Path(__file__).resolve().parents[3]

#: Worst errors of the exact families (printed by conftest's terminal summary).
WORST: dict = {}


def _architectures():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def test_the_table_lists_every_architecture():
    have = set(_architectures())
    assert not have - set(OUTCOMES), f"architectures missing from OUTCOMES: {sorted(have - set(OUTCOMES))}"
    assert not set(OUTCOMES) - have, f"OUTCOMES lists unknown architectures: {sorted(set(OUTCOMES) - have)}"
    for mt, outcome in OUTCOMES.items():
        kind, _, rest = outcome.partition(":")
        assert kind in ("exact", "refused", "skipped"), (mt, outcome)
        assert kind != "refused" or rest in PHRASES, f"{mt}: {rest!r} is not a key of zorro_verl/refusals.py"
        assert kind != "skipped" or rest, f"{mt}: a skip needs its reason"


def test_docs_page_and_readme_counts():
    assert (ROOT / "docs" / "families.md").read_text() == markdown(), \
        "docs/families.md is stale: run `python -m zorro_verl.testing.families > docs/families.md`"
    c = counts()
    line = f"{c['exact']} exact, {c['refused']} refused with the reason, {c['skipped']} skipped"
    assert line in (ROOT / "README.md").read_text(), f"README.md must say {line!r} (docs/families.md)"


def _run(model_type):
    """The ordinary per-row forward+backward and zorro's; returns the errors."""
    batch = batch_of(4, 2, 6, 3, seed=1)
    R = batch["responses"].shape[1]
    with KeepFp64():
        ref, z = tiny_family_model(model_type), tiny_family_model(model_type)
        install_zorro(z)
        ref.train(), z.train()
        lp_ref, ent_ref = ordinary_logprobs(ref, batch["input_ids"], batch["attention_mask"], R,
                                            calculate_entropy=True)
        loss_ref = _loss(lp_ref, ent_ref, batch)
        loss_ref.backward()
        plan = build_plan(batch["input_ids"], batch["attention_mask"], R, position_ids=batch["position_ids"])
        lp, ent = zorro_step(z, plan, calculate_entropy=True)
        loss = _loss(lp, ent, batch)
        loss.backward()
    g_ref, g = grads_of(ref), grads_of(z)
    scale = max(v.abs().max().item() for v in g_ref.values())
    return {"log-prob abs": (lp - lp_ref).abs().max().item(), "entropy abs": (ent - ent_ref).abs().max().item(),
            "loss abs": abs(loss.item() - loss_ref.item()),
            "grad rel": max_rel_grad_error(g_ref, g, floor=GRAD_FLOOR * scale)}


@pytest.mark.parametrize("model_type", [pytest.param(mt, marks=pytest.mark.slow) if mt in SLOW else mt
                                        for mt in sorted(OUTCOMES)])
def test_family(model_type):
    outcome = OUTCOMES[model_type]
    kind, _, rest = outcome.partition(":")
    if kind == "skipped":
        pytest.skip(f"{model_type}: {rest}")
    if kind == "refused":
        try:
            r = _run(model_type)
        except ValueError as e:
            assert PHRASES[rest] in str(e), f"{model_type}: the table says {outcome}, but it raised: {e}"
            return
        pytest.fail(f"{model_type}: the table says {outcome}, but it ran (errors {r}); update OUTCOMES")
    try:
        r = _run(model_type)
    except ValueError as e:
        pytest.fail(f"{model_type}: the table says exact, but it was refused: {e}")
    WORST[model_type] = r
    assert r["log-prob abs"] <= ABS_TOL and r["entropy abs"] <= ABS_TOL and r["loss abs"] <= ABS_TOL, r
    assert r["grad rel"][0] <= GRAD_REL_TOL, r


def test_context_reaches_attention_behind_a_layer_that_drops_kwargs():
    """StableLM's decoder layer calls its attention without ``**kwargs``: the exact result above comes through the
    call's context variable (the attention module receives no ``zorro_ctx``), and outside a zorro call the
    installed model still refuses loudly."""
    batch = batch_of(4, 2, 6, 3, seed=2)
    R = batch["responses"].shape[1]
    model = tiny_family_model("stablelm")
    install_zorro(model)
    seen = []
    model.model.layers[0].self_attn.register_forward_pre_hook(lambda m, a, kw: seen.append(set(kw)), with_kwargs=True)
    plan = build_plan(batch["input_ids"], batch["attention_mask"], R)
    with torch.no_grad():
        zorro_step(model, plan)
        assert seen and all("zorro_ctx" not in kw for kw in seen)
        with pytest.raises(ValueError, match="called without zorro's step context"):
            model(input_ids=batch["input_ids"][:1], use_cache=False)


def _phrase(key):
    return PHRASES[key].replace("(", r"\(").replace(")", r"\)")


def test_detection_is_generic():
    """The install checks look at what the model does, not at its name: a Llama whose second attention computes
    its output itself (never calling the interface), or whose first attention hands the interface a mask of its
    own, is refused with that cause and the module named."""
    model = tiny_family_model("llama")
    attn = model.model.layers[1].self_attn
    attn.forward = lambda hidden_states, **kw: (attn.o_proj(hidden_states), None)  # noqa: ARG005
    with pytest.raises(ValueError, match=_phrase("step.mixer_bypasses")) as e:
        install_zorro(model)
    assert "module LlamaAttention" in str(e.value) and model.config._attn_implementation != "zorro"

    model = tiny_family_model("llama")
    attn = model.model.layers[0].self_attn
    own = attn.forward

    def with_mask(hidden_states, attention_mask=None, **kw):
        n = hidden_states.shape[1]
        return own(hidden_states, attention_mask=torch.zeros(1, 1, n, n, dtype=hidden_states.dtype), **kw)

    attn.forward = with_mask
    with pytest.raises(ValueError, match=_phrase("step.model_mask")) as e:
        install_zorro(model)
    assert "LlamaAttention" in str(e.value)
