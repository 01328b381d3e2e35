"""The one model step (zorro_step) vs the ordinary per-row forward on tiny real transformers models, fp64.

Compared: log-probs, entropy, the PPO loss and EVERY parameter gradient. Tolerance (docs/design/testing.md):
max relative error <= 1e-9 (per-tensor ``max|Δ| / max|ref|``); measured values are ~1e-15.
"""

import pytest
import torch

from zorro_verl import packed_ppo_policy_loss
from zorro_verl.integrations.transformers import install_zorro, zorro_step
from zorro_verl.packing import build_plan
from zorro_verl.testing import create_dummy_batch, grads_of, max_rel_grad_error, ordinary_logprobs, tiny_model

REL_TOL = 1e-9
ABS_TOL = 1e-9  # log-probs / entropy / loss are O(1) numbers here

#: Worst errors seen in this module (printed by conftest's terminal summary).
WORST = {"log-prob abs": 0.0, "entropy abs": 0.0, "loss abs": 0.0, "grad rel": 0.0}


def _loss(lp, ent, batch):
    """PPO loss over response_mask tokens + an entropy bonus, so entropy gradients are compared too."""
    m = batch["response_mask"].bool()
    valid = batch["attention_mask"][:, -m.shape[1]:].bool()
    sel = m[valid]  # [N] in original row order
    pick = lambda k: batch[k][valid][sel]  # noqa: E731
    loss, _ = packed_ppo_policy_loss(lp[sel], pick("old_log_probs"), pick("advantages"), pick("ref_log_prob"),
                                     clip_ratio=0.2, kl_loss_coef=0.05)
    return loss - 0.01 * ent.mean()


def run_pair(kind="qwen3", backend="sdpa", mode="none", temperature=1.0, checkpointing=False, batch=None,
             model_kwargs=None, make=tiny_model):
    """The ordinary per-row forward+backward of one model and zorro's of an identical copy (``make(kind,
    **model_kwargs)`` builds each); returns the plan, the log-prob / entropy / loss errors and the worst gradient."""
    model_kwargs = model_kwargs or {}
    ref_model = make(kind, **model_kwargs)
    z_model = make(kind, **model_kwargs)
    install_zorro(z_model)
    for m in (ref_model, z_model):
        m.train()
        if checkpointing:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    R = batch["responses"].shape[1]
    lp_ref, ent_ref = ordinary_logprobs(ref_model, batch["input_ids"], batch["attention_mask"], R,
                                        temperature=temperature, calculate_entropy=True)
    loss_ref = _loss(lp_ref, ent_ref, batch)
    loss_ref.backward()

    plan = build_plan(batch["input_ids"], batch["attention_mask"], R, position_ids=batch["position_ids"])
    lp, ent = zorro_step(z_model, plan, backend=backend, temperature=temperature, calculate_entropy=True,
                         logits_optimization=mode, chunk_size=7)
    loss = _loss(lp, ent, batch)
    loss.backward()
    return dict(
        plan=plan,
        lp_err=(lp - lp_ref).abs().max().item(),
        ent_err=(ent - ent_ref).abs().max().item(),
        loss_err=abs(loss.item() - loss_ref.item()),
        grad_err=max_rel_grad_error(grads_of(ref_model), grads_of(z_model)),
    )


def assert_equal(r):
    for key, val in (("log-prob abs", r["lp_err"]), ("entropy abs", r["ent_err"]), ("loss abs", r["loss_err"]),
                     ("grad rel", r["grad_err"][0])):
        WORST[key] = max(WORST[key], val)
    assert r["lp_err"] <= ABS_TOL, r
    assert r["ent_err"] <= ABS_TOL, r
    assert r["loss_err"] <= ABS_TOL, r
    assert r["grad_err"][0] <= REL_TOL, r


def batch_of(B=8, G=3, P=14, R=6, seed=0, shuffle=True, padding=True):
    return create_dummy_batch(B, G, P, R, device="cpu", include_training_fields=True, add_padding=padding,
                              shuffle=shuffle, vocab_size=128, seed=seed)


@pytest.mark.parametrize("mode", ["none", "compute", "memory"])
@pytest.mark.parametrize("backend", ["sdpa", "eager", "standard"])
@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_models_backends_logit_modes(kind, backend, mode):
    temperature = 0.7 if mode != "none" else 1.0
    r = run_pair(kind, backend, mode, temperature, batch=batch_of(seed=len(kind) * 100 + len(backend) * 10 + len(mode)))
    assert r["plan"].G == 3 and r["plan"].T < r["plan"].ordinary_tokens
    assert_equal(r)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_gradient_checkpointing(kind, temperature):
    assert_equal(run_pair(kind, "sdpa", "memory", temperature, checkpointing=True, batch=batch_of(seed=7)))


@pytest.mark.parametrize("model_kwargs", [dict(gqa=False), dict(tie_word_embeddings=True), dict(layers=3, heads=2)])
def test_mha_tied_embeddings_and_shapes(model_kwargs):
    assert_equal(run_pair("qwen3", "sdpa", "none", 0.7, batch=batch_of(seed=3), model_kwargs=model_kwargs))


@pytest.mark.parametrize("backend", ["eager", "sdpa"])  # sdpa with G == B takes the row layout
@pytest.mark.parametrize("B,G,P,R", [(5, 1, 9, 4), (4, 4, 6, 3), (7, 2, 1, 5), (6, 3, 10, 1), (3, 2, 8, 0)])
def test_group_structures(B, G, P, R, backend):
    """G=1 (all share), G=B (no sharing), 1-token prompts, 1-token responses, zero-width responses."""
    batch = batch_of(B, G, P, R, seed=B * 10 + G)
    if R == 0:
        plan = build_plan(batch["input_ids"], batch["attention_mask"], 0)
        assert plan.N == 0
        return _zero_width(batch)
    r = run_pair("qwen3", backend, "none", 1.0, batch=batch)
    assert r["plan"].G == G
    assert_equal(r)


def _zero_width(batch):
    model = tiny_model("qwen3")
    install_zorro(model)
    plan = build_plan(batch["input_ids"], batch["attention_mask"], 0)
    lp, ent = zorro_step(model, plan, calculate_entropy=True)
    assert lp.shape == (0,) and ent.shape == (0,)


def test_flex_forward_matches():
    """FlexAttention (CPU: forward only) gives the same log-probs and entropy."""
    batch = batch_of(seed=11)
    ref_model, z_model = tiny_model("qwen3"), tiny_model("qwen3")
    install_zorro(z_model)
    R = batch["responses"].shape[1]
    with torch.no_grad():
        lp_ref, ent_ref = ordinary_logprobs(ref_model, batch["input_ids"], batch["attention_mask"], R,
                                            temperature=0.7, calculate_entropy=True)
        plan = build_plan(batch["input_ids"], batch["attention_mask"], R)
        lp, ent = zorro_step(z_model, plan, backend="flex", temperature=0.7, calculate_entropy=True)
    assert (lp - lp_ref).abs().max().item() <= ABS_TOL
    assert (ent - ent_ref).abs().max().item() <= ABS_TOL


def test_interleaved_equals_sorted_rows():
    """Row order does not matter: the same batch shuffled gives the same per-row values."""
    b1 = batch_of(seed=5, shuffle=False)
    g = torch.Generator().manual_seed(1)
    perm = torch.randperm(b1["input_ids"].shape[0], generator=g)
    b2 = {k: v[perm] for k, v in b1.items()}
    model = tiny_model("qwen3")
    install_zorro(model)
    outs = []
    for b in (b1, b2):
        plan = build_plan(b["input_ids"], b["attention_mask"], 6)
        with torch.no_grad():
            outs.append(plan.to_padded(zorro_step(model, plan)[0]))
    assert (outs[0][perm] - outs[1]).abs().max().item() <= 1e-12


def test_per_row_temperatures_as_verl_passes_them():
    """A per-row temperature tensor (verl's per-sample temperatures): each row's log-probs / entropy equal the
    ordinary forward at that row's temperature; all-equal tensors equal the float path exactly."""
    batch = batch_of(seed=13)
    R = batch["responses"].shape[1]
    B = batch["input_ids"].shape[0]
    model = tiny_model("qwen3")
    z_model = tiny_model("qwen3")
    install_zorro(z_model)
    plan = build_plan(batch["input_ids"], batch["attention_mask"], R)
    temps = torch.linspace(0.5, 1.2, B, dtype=torch.float64)
    with torch.no_grad():
        lp, ent = zorro_step(z_model, plan, temperature=temps, calculate_entropy=True)
        for b in range(B):
            rows = plan.out_row == b
            if not rows.any():  # an empty response
                continue
            one = {k: v[b:b + 1] for k, v in batch.items()}
            lp_b, ent_b = ordinary_logprobs(model, one["input_ids"], one["attention_mask"], R,
                                            temperature=float(temps[b].float()), calculate_entropy=True)
            assert (lp[rows] - lp_b).abs().max().item() <= ABS_TOL
            assert (ent[rows] - ent_b).abs().max().item() <= ABS_TOL
        same = torch.full((B,), 0.75)
        for mode in ("none", "compute"):
            a = zorro_step(z_model, plan, temperature=same, calculate_entropy=True, logits_optimization=mode)
            b_ = zorro_step(z_model, plan, temperature=0.75, calculate_entropy=True, logits_optimization=mode)
            assert torch.equal(a[0], b_[0]) and torch.equal(a[1], b_[1])
        # memory mode takes one temperature: equal values are accepted, different ones refused
        lp_m, _ = zorro_step(z_model, plan, temperature=same, logits_optimization="memory")
        assert (lp_m - zorro_step(z_model, plan, temperature=0.75)[0]).abs().max().item() <= ABS_TOL
        with pytest.raises(ValueError, match="per-row temperatures"):
            zorro_step(z_model, plan, temperature=temps, logits_optimization="memory")
        with pytest.raises(ValueError, match="one value per row"):
            zorro_step(z_model, plan, temperature=temps[:3])


def test_layer_calls_are_counted_per_step():
    from zorro_verl.integrations.transformers import LayerCalls, expected_layer_calls

    batch = batch_of(seed=2)
    model = tiny_model("qwen3", layers=3)
    install_zorro(model)
    plan = build_plan(batch["input_ids"], batch["attention_mask"], batch["responses"].shape[1])
    calls = LayerCalls()
    with torch.no_grad():
        zorro_step(model, plan, calls=calls)
        assert (calls.attention, calls.recurrent) == expected_layer_calls(model) == (3, 0)
        zorro_step(model, plan, calls=calls)  # reset at each step, not accumulated
    assert calls.attention == 3 and calls.fallbacks == {}
    with pytest.raises(ValueError, match="expected one of"):
        zorro_step(model, plan, backend="flash_attention_2")


def test_step_context_passes_fsdp_style_input_casting_by_reference():
    """FSDP2 casts forward kwargs with torch.distributed.utils._apply_to_tensors, which rebuilds dataclasses and
    dicts: the opaque StepContext must come through as the same object, so the layer counts reach the caller."""
    from torch.distributed.utils import _apply_to_tensors

    from zorro_verl.integrations.transformers import StepContext

    batch = batch_of(seed=1)
    ctx = StepContext(build_plan(batch["input_ids"], batch["attention_mask"], batch["responses"].shape[1]))
    assert _apply_to_tensors(lambda t: t, {"zorro_ctx": ctx})["zorro_ctx"] is ctx
    with pytest.raises(TypeError, match="ZorroPlan"):
        StepContext(batch)


def test_head_fn_runs_as_the_head_forward_and_refuses_post_processed_logits():
    """A head function sees the [N, H] response-predicting hidden states inside the head module's forward (so FSDP
    gathers the head once); a model that changes the head's output before returning it is refused, not misread."""
    batch = batch_of(seed=4)
    R = batch["responses"].shape[1]
    model = tiny_model("qwen3")
    install_zorro(model)
    plan = build_plan(batch["input_ids"], batch["attention_mask"], R)
    seen = {}

    def head_fn(hidden, head, targets, temperature, calculate_entropy, index):
        seen["shape"], seen["head"], seen["index"] = tuple(hidden.shape), head, index
        logits = torch.nn.functional.linear(hidden, head.weight).double() / temperature
        lp = logits.log_softmax(-1).gather(-1, targets[:, None])[:, 0]
        return lp, (-(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1) if calculate_entropy else None)

    with torch.no_grad():
        lp, ent = zorro_step(model, plan, temperature=0.8, calculate_entropy=True, head_fn=head_fn)
        ref_lp, ref_ent = zorro_step(model, plan, temperature=0.8, calculate_entropy=True)
    assert seen["shape"] == (plan.N, model.config.hidden_size) and seen["head"] is model.lm_head
    assert seen["index"] is None  # the prompt plan: one hidden row per output
    assert (lp - ref_lp).abs().max().item() <= 1e-12 and (ent - ref_ent).abs().max().item() <= 1e-12
    assert "forward" not in model.lm_head.__dict__  # the swap is undone
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="soft-caps"):
        zorro_step(model, plan, logits_optimization="memory")


@pytest.mark.parametrize("hook,accepted", [("clone", False), ("detach", False), ("in_place", False),
                                            ("view_as", True)])
def test_memory_mode_checks_what_the_head_output_became(hook, accepted):
    """The memory mode reads the root's ``logits`` as the head function's results, so it accepts only the head's
    output itself or an alias with the same storage whose gradient reaches it (DeepSpeed ZeRO-3 hands every module's
    output through such an identity; tested on the real engine in tests/integrations/openrlhf/test_deepspeed.py):
    a copy (any arithmetic makes new storage), the output changed in place (the same tensor object, its version
    bumped) or a tensor cut from the graph is refused."""
    batch = batch_of(seed=5)
    R = batch["responses"].shape[1]
    model = tiny_model("qwen3")
    install_zorro(model)
    plan = build_plan(batch["input_ids"], batch["attention_mask"], R)
    ref_lp, _ = zorro_step(model, plan, logits_optimization="memory", chunk_size=7)
    ref_lp.sum().backward()
    ref_grad = model.lm_head.weight.grad.clone()
    model.zero_grad()
    change = {"clone": torch.Tensor.clone, "detach": torch.Tensor.detach, "view_as": lambda t: t.view_as(t),
              "in_place": lambda t: t.mul_(2.0)}[hook]
    handle = model.lm_head.register_forward_hook(lambda module, args, out: change(out))
    try:
        if not accepted:
            with pytest.raises(ValueError, match="transformed its head's output"):
                zorro_step(model, plan, logits_optimization="memory", chunk_size=7)
            return
        lp, _ = zorro_step(model, plan, logits_optimization="memory", chunk_size=7)
        lp.sum().backward()
    finally:
        handle.remove()
    assert torch.equal(lp, ref_lp) and torch.equal(model.lm_head.weight.grad, ref_grad)


def test_bf16_temperature_tensor_divides_as_verl_in_every_mode():
    """bf16 model, the temperature as verl 0.9's engine hands it over (a per-row tensor, here all 0.7): every mode
    divides the bf16 logits by the bf16 temperature before the softmax (verl's ``logits / T.to(logits.dtype)``; the
    materialised modes ran it as a per-row ``[N, V]`` division before, now per block), so the memory mode's
    log-probs / entropy equal the materialised modes' up to fp32 summation order. The memory mode used to divide
    the fp32 upcast by the exact T, as a float temperature still does (``temperature_op="upcast"``): 3e-4 nats
    mean off verl's values here (this random model's logits are small; ~1e-2 at logits of a few units). Rows with
    different temperatures still run the per-row division (none / compute)."""
    batch = batch_of(seed=3)
    R, B = batch["responses"].shape[1], batch["input_ids"].shape[0]
    model = tiny_model("qwen3", dtype=torch.bfloat16)
    install_zorro(model)
    plan = build_plan(batch["input_ids"], batch["attention_mask"], R)
    temps = torch.full((B,), 0.7)
    with torch.no_grad():
        outs = {mode: zorro_step(model, plan, temperature=temps, calculate_entropy=True, logits_optimization=mode,
                                 chunk_size=5) for mode in ("none", "compute", "memory")}
        upcast = zorro_step(model, plan, temperature=0.7, calculate_entropy=True, logits_optimization="memory")
        mixed = temps.clone()
        mixed[0] = 0.9  # not uniform: the per-row [N, V] division, verl's op on every row
        lp_mixed, _ = zorro_step(model, plan, temperature=mixed, logits_optimization="none")
    rows = plan.out_row != 0
    for mode, (lp, ent) in outs.items():
        assert lp.dtype == torch.float32
        assert (lp - outs["none"][0]).abs().max().item() <= 1e-5, mode
        assert (ent - outs["none"][1]).abs().max().item() <= 1e-5, mode
    assert (lp_mixed[rows] - outs["none"][0][rows]).abs().max().item() <= 1e-5
    assert (upcast[0] - outs["memory"][0]).abs().mean().item() > 1e-4  # the old memory-mode rounding


@pytest.mark.parametrize("key", ["router_jitter_noise", "resid_pdrop"])
def test_per_token_noise_refused_in_training(key):
    """A per-token random op in training mode (Mixtral's router input jitter, a residual dropout) would be drawn once
    per shared prompt token instead of once per row: refused by name; in eval mode (no noise) the step runs."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from zorro_verl.integrations.transformers import install_zorro, zorro_step
    from zorro_verl.packing import build_plan
    from zorro_verl.testing import create_dummy_batch

    cfg = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        **{key: 0.1})
    model = MixtralForCausalLM(cfg)
    install_zorro(model)
    b = create_dummy_batch(4, 2, 5, 3, device="cpu", seed=0, vocab_size=64)
    plan = build_plan(b["input_ids"], b["attention_mask"], b["responses"].shape[1])
    model.train()
    with pytest.raises(ValueError, match=f"config.{key} = 0.1 in training mode"):
        zorro_step(model, plan)
    model.eval()
    logp, _ = zorro_step(model, plan)
    assert logp.shape == (plan.N,) and torch.isfinite(logp).all()
