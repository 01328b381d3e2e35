"""Other sequence mixers: LFM2 / LFM2-MoE short gated convs, MiniMax lightning attention and OLMo-hybrid's gated
delta-net layout, ZoRRo vs the ordinary per-row forward.

Tolerances:

* fp64 (the family's own per-row forward; ``exact_fp64_norms`` / ``exact_fp64_hybrid`` keep the norms, routers,
  OLMo-hybrid's log-decay and MiniMax's decay buffers in fp64; the lightning attention and the short conv are
  transformers' own code): log-probs / entropy within ``1e-12`` absolute (measured 8.9e-16 / 2.7e-15); gradients per
  parameter ``max|Δ|/max|ref| <= 1e-12`` (measured <= 8e-15 — zorro runs the recurrences chunked differently, and
  the per-row conv vs the context-expanded one, so they differ by rounding only).
* fp32 with the stock transformers forward (no swaps): zorro's error vs the fp64 oracle at most 2x (log-probs,
  entropy) / 3x (gradients) the error of the ordinary fp32 forward vs the same oracle (docs/design/testing.md).
"""

import copy

import pytest
import torch

from tests.recurrent.test_recurrent import _batch
from tests.support.recurrent_checks import assert_exact_fp64, assert_relative_rule, grads, one_thread, oracle
from zorro_verl.integrations.transformers import (
    LayerCalls,
    expected_layer_calls,
    hybrid,
    install_zorro,
    is_installed,
    mixers,
    uninstall_zorro,
    zorro_step,
)
from zorro_verl.packing import build_plan
from zorro_verl.testing import (
    MIXER_KINDS,
    batch_from_rows,
    exact_fp64_hybrid,
    exact_fp64_norms,
    max_rel_grad_error,
    ordinary_logprobs,
    shared_system_rows,
    tiny_mixer_model,
)

_one_thread = pytest.fixture(autouse=True)(one_thread)
_grads, _oracle = grads, oracle




CASES = {
    # B, G, P, R: interleaved siblings, 1-token and empty responses (create_dummy_batch add_padding + shuffle)
    "mixed": dict(B=6, G=2, P=11, R=7),
    "short_prompts": dict(B=5, G=2, P=1, R=5),  # prompts shorter than the conv context (zeros before them)
    "long": dict(B=3, G=1, P=30, R=26),  # prompts and responses cross many 4-token lightning blocks
}


@pytest.mark.parametrize("kind,case", [(k, "mixed") for k in MIXER_KINDS] + [("lfm2", "short_prompts"),
                                                                            ("minimax", "long")])
def test_zorro_equals_ordinary_fp64(kind, case):
    c = CASES[case]
    batch = _batch(B=c["B"], G=c["G"], P=c["P"], R=c["R"], seed=11)
    R = c["R"]
    model = tiny_mixer_model(kind, seed=1)
    model.train()
    lp_ref, ent_ref, g_ref = _oracle(model, batch, R)
    install_zorro(model)
    plan = build_plan(batch["input_ids"], batch["attention_mask"], R, position_ids=batch["position_ids"])
    assert plan.N == lp_ref.numel() and plan.T < plan.ordinary_tokens
    calls = LayerCalls()
    assert_exact_fp64(model, plan, lp_ref, ent_ref, g_ref, calls)
    attn, rec = expected_layer_calls(model)
    assert calls.recurrent == rec == 2 and calls.attention == attn == 1 and not calls.fallbacks


@pytest.mark.parametrize("kind", MIXER_KINDS[1:])
def test_prefix_tree_carries_state_down_the_trie_fp64(kind):
    """sharing='prefix': a shared system prompt over two questions, a branching rollout (nodes at depth 3) and
    nodes shorter than the conv context, vs the ordinary per-row forward: each node's conv context spans its
    ancestors, the recurrent state runs from its parent's final state."""
    from tests.attention.test_tree_backends import branching_rows

    rows = shared_system_rows(2, 2, system_len=9, question_len=2, response_len=5, vocab_size=100, seed=5)
    rows += branching_rows(depth=3, width=2, turn=1, seed=6)  # 1-token nodes: the conv context spans ancestors
    batch = batch_from_rows(rows)
    R = batch["responses"].shape[1]
    model = tiny_mixer_model(kind, seed=1)
    model.train()
    lp_ref, ent_ref, g_ref = _oracle(model, batch, R)
    install_zorro(model)
    plan = build_plan(batch["input_ids"], batch["attention_mask"], R, sharing="prefix", min_shared_len=1)
    assert plan.tree.levels == 4 and min(plan.tree.node_len.tolist()) < 2
    assert_exact_fp64(model, plan, lp_ref, ent_ref, g_ref)


@pytest.mark.parametrize("kind", ["lfm2", "olmo_hybrid", "minimax"])
def test_gradient_checkpointing_fp64(kind):
    """LFM2's and OLMo-hybrid's decoder layers call the mixer without kwargs: the layer carrier hands the context
    over again when gradient checkpointing re-runs the layer (MiniMax's layer passes it on). Same values and
    gradients."""
    batch = _batch(B=4, G=2, P=6, R=4, seed=2)
    plan = build_plan(batch["input_ids"], batch["attention_mask"], 4)
    model = tiny_mixer_model(kind, seed=2)
    model.train()
    install_zorro(model)
    lp0, ent0 = zorro_step(model, plan, calculate_entropy=True)
    g0 = _grads(model, lp0, ent0)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lp, ent = zorro_step(model, plan, calculate_entropy=True)
    g1 = _grads(model, lp, ent)
    assert (lp - lp0).abs().max().item() == 0 and (ent - ent0).abs().max().item() == 0
    assert max_rel_grad_error(g0, g1)[0] < 1e-14


# ---------------------------------------------------------------------------------------------------- fp32
@pytest.mark.parametrize("kind", MIXER_KINDS)
def test_zorro_fp32_stock_forward(kind):
    """fp32, transformers' own forward (its conv, its block-wise lightning attention, its torch delta-rule kernel,
    norms and casts; no swaps) — what runs on a CPU host."""
    batch = _batch(B=6, G=2, P=10, R=6, seed=4)
    R = 6
    m32 = tiny_mixer_model(kind, dtype=torch.float32, seed=3, exact=False)
    m64 = copy.deepcopy(m32).to(torch.float64)
    if hasattr(m64.config, "num_experts") or hasattr(m64.config, "num_local_experts"):
        m64.set_experts_implementation("eager")  # grouped_mm has no fp64 kernel
    exact_fp64_norms(m64)
    exact_fp64_hybrid(m64)
    for m in (m32, m64):
        m.train()
    assert_relative_rule(m32, m64, batch, R)


# ---------------------------------------------------------------------------------------------------- install / errors
def test_install_wraps_instances_and_uninstall_restores():
    """LFM2: the conv modules and their layer carriers; MiniMax: the lightning modules (not listed as gated
    delta-nets); OLMo-hybrid: the delta-nets and their layer carriers. Uninstall restores every forward."""
    batch = _batch(B=3, G=1, P=5, R=3)
    for kind in ("lfm2", "minimax", "olmo_hybrid"):
        model = tiny_mixer_model(kind, seed=4, exact=False)
        before, _ = ordinary_logprobs(model, batch["input_ids"], batch["attention_mask"], 3)
        layers = model.model.layers
        if kind == "lfm2":
            mods = [m for _, _, m in mixers.short_conv_modules(model)]
            carriers = [layers[0], layers[2]]
        elif kind == "minimax":
            mods = [m for _, m in mixers.lightning_modules(model)]
            carriers = []
            assert hybrid.linear_attention_modules(model) == []
        else:
            mods = [m for _, m in hybrid.linear_attention_modules(model)]
            carriers = [layers[0], layers[2]]
        assert len(mods) == 2 and expected_layer_calls(model) == (1, 2)
        keys = list(model.state_dict())
        install_zorro(model)
        install_zorro(model)  # idempotent
        assert is_installed(model) and all(mixers.is_wrapped(m) for m in mods + carriers)
        assert list(model.state_dict()) == keys  # no module registered twice by the carriers
        assert not mixers.is_wrapped(layers[1])
        with pytest.raises(ValueError, match="without zorro's step context"):
            mods[0](torch.zeros(1, 3, 32, dtype=torch.float64))
        uninstall_zorro(model)
        assert not is_installed(model) and not any(mixers.is_wrapped(m) for m in mods + carriers)
        assert all("forward" not in m.__dict__ for m in mods + carriers)
        after, _ = ordinary_logprobs(model, batch["input_ids"], batch["attention_mask"], 3)
        assert torch.equal(before, after)


def test_ulysses_sizes_that_do_not_divide_are_refused_by_name():
    """Under Ulysses each rank runs whole conv channels (hidden 32) / lightning heads (4): sp must divide them
    (the exchange itself: test_ulysses_step.py)."""
    for kind, what in (("lfm2", "short conv's channels (hidden_size = 32"),
                       ("minimax", "lightning attention's heads (num_attention_heads = 4")):
        model = tiny_mixer_model(kind, seed=0, exact=False)
        assert mixers.mixers_sp_unsupported(model, 1) is None and mixers.mixers_sp_unsupported(model, 2) is None
        reason = mixers.mixers_sp_unsupported(model, 3)
        assert reason.startswith("ulysses_sequence_parallel_size: 3 must divide the ") and what in reason


def test_unknown_conv_module_raises_at_install():
    model = tiny_mixer_model("lfm2", seed=0)
    prev = model.config._attn_implementation
    model.model.layers[2].conv = torch.nn.Conv1d(32, 32, 3, groups=32).double()  # not LFM2's short gated conv
    with pytest.raises(ValueError, match="whose `conv` module zorro does not know"):
        install_zorro(model)
    assert model.config._attn_implementation == prev
    assert not mixers.is_wrapped(model.model.layers[0].conv)
