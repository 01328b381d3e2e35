"""Hybrid linear-attention models: Qwen3.5 dense / MoE and Qwen3-Next, ZoRRo vs the ordinary forward.

Tolerances:

* fp64 (``exact_fp64_hybrid`` oracle, same dtype-preserving kernel for both sides): log-probs / entropy within
  ``1e-12`` absolute (measured ~3e-15). Gradients: per parameter ``max|Δ|/max|ref| <= max(1e-12, 4 * self_err)``
  where ``self_err`` is how much the oracle itself moves when the delta rule is chunked differently (4 instead of
  64 tokens; equal in exact arithmetic). That is ~1e-15 for most parameters but up to ~3e-11 for ``A_log`` /
  ``dt_bias``: their gradient sums many decay terms ``exp(cumsum g)`` with cancellation, and zorro necessarily chunks
  differently (a prompt and each response are separate kernel sequences).
* fp32 with the stock transformers kernels (no swaps): zorro's error vs the fp64 oracle must be at most 2x (log-probs,
  entropy) / 3x (gradients) the error of the ordinary fp32 forward vs the same fp64 oracle (docs/design/testing.md).
"""

import copy
import functools

import pytest
import torch

from tests.recurrent.test_recurrent import _batch
from tests.support.recurrent_checks import assert_relative_rule, grads, one_thread, oracle
from zorro_verl.integrations.transformers import (
    LayerCalls,
    expected_layer_calls,
    hybrid,
    install_zorro,
    is_installed,
    uninstall_zorro,
    zorro_step,
)
from zorro_verl.packing import build_plan
from zorro_verl.recurrent import chunk_gated_delta_rule_ref
from zorro_verl.testing import (
    exact_fp64_hybrid,
    max_rel_grad_error,
    ordinary_logprobs,
    tiny_hybrid_model,
)

KINDS = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


_one_thread = pytest.fixture(autouse=True)(one_thread)
_grads, _oracle = grads, oracle

LP_ABS_TOL = 1e-12
GRAD_REL_FLOOR = 1e-12


# ---------------------------------------------------------------------------------------------------- models, fp64
def _set_kernel(model, kernel):
    for _, mod in hybrid.linear_attention_modules(model):
        mod.chunk_gated_delta_rule = kernel


CASES = {
    # B, G, P, R: interleaved siblings, 1-token and empty responses (create_dummy_batch add_padding + shuffle)
    "mixed": dict(B=6, G=2, P=11, R=7),
    "short_prompts": dict(B=5, G=2, P=2, R=5),  # prompts shorter than the conv context (zeros before them)
    "long": dict(B=3, G=1, P=70, R=66),  # both the prompt and responses cross 64-token kernel chunks
}


@pytest.mark.parametrize("kind,case", [(k, "mixed") for k in KINDS] + [("qwen3_5", "short_prompts"),
                                                                      ("qwen3_next", "long")])
def test_zorro_equals_ordinary_fp64(kind, case):
    c = CASES[case]
    batch = _batch(B=c["B"], G=c["G"], P=c["P"], R=c["R"], seed=11)
    R = c["R"]
    model = tiny_hybrid_model(kind, dtype=torch.float64, seed=1)
    model.train()
    lp_ref, ent_ref, g_ref = _oracle(model, batch, R)
    _set_kernel(model, functools.partial(chunk_gated_delta_rule_ref, chunk_size=4))
    _, _, g_rechunk = _oracle(model, batch, R)  # the oracle's own sensitivity to chunking
    _set_kernel(model, chunk_gated_delta_rule_ref)

    install_zorro(model)
    plan = build_plan(batch["input_ids"], batch["attention_mask"], R, position_ids=batch["position_ids"])
    assert plan.N == lp_ref.numel() and plan.T < plan.ordinary_tokens
    calls = LayerCalls()
    lp, ent = zorro_step(model, plan, calculate_entropy=True, calls=calls)
    assert calls.recurrent == 2 and calls.attention == 1 and not calls.fallbacks
    g_z = _grads(model, lp, ent)

    assert (lp - lp_ref).abs().max().item() < LP_ABS_TOL
    assert (ent - ent_ref).abs().max().item() < LP_ABS_TOL
    assert set(g_z) == set(g_ref) and len(g_ref) == len(list(model.parameters()))
    for name, ref in g_ref.items():
        assert ref.abs().max().item() > 0, name  # every parameter matters
        self_err, _ = max_rel_grad_error({name: ref}, {name: g_rechunk[name]})
        err, _ = max_rel_grad_error({name: ref}, {name: g_z[name]})
        assert err <= max(GRAD_REL_FLOOR, 4 * self_err), (name, err, self_err)


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_prefix_tree_carries_state_down_the_trie_fp64(kind):
    """sharing='prefix': a shared system prompt over two questions, a branching rollout (nodes at depth 3) and
    nodes shorter than the conv context, vs the ordinary per-row forward. The recurrent state runs from each node's
    parent's final state; each node's conv context spans its ancestors. Tolerances as above."""
    from tests.attention.test_tree_backends import branching_rows
    from zorro_verl.testing import batch_from_rows, shared_system_rows

    rows = shared_system_rows(2, 2, system_len=9, question_len=2, response_len=5, vocab_size=100, seed=5)
    rows += branching_rows(depth=3, width=2, turn=2, seed=6)  # 2-token nodes: the conv context spans ancestors
    batch = batch_from_rows(rows)
    R = batch["responses"].shape[1]
    model = tiny_hybrid_model(kind, dtype=torch.float64, seed=1)
    model.train()
    lp_ref, ent_ref, g_ref = _oracle(model, batch, R)
    _set_kernel(model, functools.partial(chunk_gated_delta_rule_ref, chunk_size=4))
    _, _, g_rechunk = _oracle(model, batch, R)
    _set_kernel(model, chunk_gated_delta_rule_ref)
    install_zorro(model)
    plan = build_plan(batch["input_ids"], batch["attention_mask"], R, sharing="prefix", min_shared_len=1)
    assert plan.tree.levels == 4 and min(plan.tree.node_len.tolist()) < 3
    lp, ent = zorro_step(model, plan, calculate_entropy=True)
    g_z = _grads(model, lp, ent)
    assert (lp - lp_ref).abs().max().item() < LP_ABS_TOL
    assert (ent - ent_ref).abs().max().item() < LP_ABS_TOL
    for name, ref in g_ref.items():
        self_err, _ = max_rel_grad_error({name: ref}, {name: g_rechunk[name]})
        err, _ = max_rel_grad_error({name: ref}, {name: g_z[name]})
        assert err <= max(GRAD_REL_FLOOR, 4 * self_err), (name, err, self_err)


def test_gradient_checkpointing_fp64():
    """Checkpointed layers re-run the wrapped forward (the plan travels as a kwarg): same values and gradients."""
    batch = _batch(B=4, G=2, P=6, R=4, seed=2)
    plan = build_plan(batch["input_ids"], batch["attention_mask"], 4)
    model = tiny_hybrid_model("qwen3_5", seed=2)
    model.train()
    lp_ref, _, _ = _oracle(model, batch, 4)
    install_zorro(model)
    lp0, ent0 = zorro_step(model, plan, calculate_entropy=True)
    g0 = _grads(model, lp0, ent0)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lp, ent = zorro_step(model, plan, calculate_entropy=True)
    g1 = _grads(model, lp, ent)
    assert (lp - lp_ref).abs().max().item() < LP_ABS_TOL
    assert (lp - lp0).abs().max().item() == 0 and (ent - ent0).abs().max().item() == 0
    assert max_rel_grad_error(g0, g1)[0] < 1e-14


# ---------------------------------------------------------------------------------------------------- models, fp32
@pytest.mark.parametrize("kind", KINDS)
def test_zorro_fp32_stock_kernels(kind):
    """fp32, transformers' own torch fallback kernels and norms (no swaps) — what runs on a CPU host."""
    batch = _batch(B=6, G=2, P=10, R=6, seed=4)
    R = 6
    m32 = tiny_hybrid_model(kind, dtype=torch.float32, seed=3, exact=False)
    m64 = copy.deepcopy(m32).to(torch.float64)
    if hasattr(m64.config, "num_experts"):
        m64.set_experts_implementation("eager")  # grouped_mm has no fp64 kernel
    exact_fp64_hybrid(m64)
    for m in (m32, m64):
        m.train()
    assert_relative_rule(m32, m64, batch, R)


# ---------------------------------------------------------------------------------------------------- install / errors
def test_install_wraps_instances_and_uninstall_restores():
    model = tiny_hybrid_model("qwen3_next", seed=4)
    batch = _batch(B=3, G=1, P=5, R=3)
    before, _ = ordinary_logprobs(model, batch["input_ids"], batch["attention_mask"], 3)
    mods = hybrid.linear_attention_modules(model)
    saved = [m.__dict__["forward"] for _, m in mods]  # the exact oracle's instance forward
    assert [i for i, _ in mods] == [0, 2] and expected_layer_calls(model) == (1, 2)
    install_zorro(model)
    install_zorro(model)  # idempotent
    assert is_installed(model) and all(hybrid.is_wrapped(m) for _, m in mods)
    cls = type(mods[0][1])
    assert "_zorro_saved_forward" not in cls.__dict__ and cls.forward.__name__ == "forward"  # class untouched
    with pytest.raises(ValueError, match="without zorro's step context"):
        mods[0][1](torch.zeros(1, 3, 32, dtype=torch.float64))
    uninstall_zorro(model)
    assert not is_installed(model) and not any(hybrid.is_wrapped(m) for _, m in mods)
    assert all(m.__dict__["forward"] is f for (_, m), f in zip(mods, saved))
    after, _ = ordinary_logprobs(model, batch["input_ids"], batch["attention_mask"], 3)
    assert torch.equal(before, after)
    # A stock module (no instance forward) gets its class forward back.
    stock = tiny_hybrid_model("qwen3_5", seed=0, exact=False)
    install_zorro(stock)
    uninstall_zorro(stock)
    assert all("forward" not in m.__dict__ for _, m in hybrid.linear_attention_modules(stock))


def test_bypassed_linear_layer_is_caught():
    model = tiny_hybrid_model("qwen3_5", seed=0)
    install_zorro(model)
    _, mod = hybrid.linear_attention_modules(model)[1]
    mod.forward = mod.__dict__.pop("_zorro_saved_forward")  # someone re-patched it after install
    batch = _batch(B=2, G=1, P=4, R=2)
    with pytest.raises(ValueError, match="short-conv layers but zorro's recurrent forwards ran 1"):
        zorro_step(model, build_plan(batch["input_ids"], batch["attention_mask"], 2))


def test_unsupported_layer_type_raises_at_install():
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8, intermediate_size=32,
                      layer_types=["full_attention", "heavily_compressed_attention"])  # a type zorro does not handle
    model = AutoModelForCausalLM.from_config(cfg)
    prev = model.config._attn_implementation
    with pytest.raises(ValueError, match="heavily_compressed_attention"):
        install_zorro(model)
    assert model.config._attn_implementation == prev


def test_unknown_linear_attention_module_raises_at_install():
    model = tiny_hybrid_model("qwen3_5", seed=0)
    prev = model.config._attn_implementation
    model.model.layers[2].linear_attn = torch.nn.Linear(32, 32).double()  # an unknown sequence mixer
    with pytest.raises(ValueError, match="not a gated delta-net zorro knows"):
        install_zorro(model)
    assert model.config._attn_implementation == prev
    assert not hybrid.is_wrapped(model.model.layers[0].linear_attn)


# ---------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ("qwen3_5", "qwen3_next"))
def test_gpu_bf16_relative_rule(kind):
    """bf16 on CUDA (flash-linear-attention when installed, else the warned torch fallback): error vs the fp64
    oracle <= 2x (log-probs) / 3x (grads) that of the ordinary bf16 forward."""
    batch = {k: v.cuda() for k, v in _batch(B=8, G=2, P=150, R=90, seed=6).items()}
    R = 90
    # Head dims of 16/32: the Triton kernels of flash-linear-attention need dot sizes >= 16.
    m16 = tiny_hybrid_model(kind, dtype=torch.float32, seed=5, exact=False, hidden=64, linear_head_dim=32)
    m16 = m16.to("cuda", torch.bfloat16)
    m64 = copy.deepcopy(m16).to(torch.float64)
    if hasattr(m64.config, "num_experts"):
        m64.set_experts_implementation("eager")
    exact_fp64_hybrid(m64)
    lp64, _, g64 = _oracle(m64, batch, R)
    lp_o, _, g_o = _oracle(m16, batch, R)
    install_zorro(m16)
    lp_z, ent_z = zorro_step(m16, build_plan(batch["input_ids"], batch["attention_mask"], R),
                                calculate_entropy=True)
    g_z = _grads(m16, lp_z, ent_z)
    up = lambda g: {n: t.double() for n, t in g.items()}  # noqa: E731
    ref_lp = (lp_o.double() - lp64).abs().max().item()
    assert (lp_z.double() - lp64).abs().max().item() <= 2 * ref_lp
    assert max_rel_grad_error(g64, up(g_z))[0] <= 3 * max_rel_grad_error(g64, up(g_o))[0]


def test_sp_head_split_of_the_delta_net():
    """Under Ulysses SP the delta-net's value heads are split over the ranks; key heads are repeated per value head
    when SP does not divide them; SP must divide the value heads (refused by name otherwise)."""
    assert hybrid.linear_attention_sp_repeat(2, 4, 2) == 1
    assert hybrid.linear_attention_sp_repeat(2, 4, 4) == 2
    assert hybrid.linear_attention_sp_repeat(1, 4, 2) == 4
    with pytest.raises(ValueError, match="linear_num_value_heads"):
        hybrid.linear_attention_sp_repeat(2, 6, 4)
