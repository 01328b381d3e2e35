"""The reference API (docs/design/api.md): its examples, round trips, the loss, the actor and the patcher."""

import pytest
import torch

from zorro_verl import DeduplicatedActor, ReconstructionInfo, ZoRRoTrain, packed_ppo_policy_loss
from zorro_verl.integrations.transformers import zorro_step
from zorro_verl.testing import (
    create_dummy_batch,
    exact_fp64_norms,
    grads_of,
    max_rel_grad_error,
    ordinary_logprobs,
    tiny_model,
)


def test_find_prompt_groups_example():
    input_ids = torch.tensor([
        [1, 2, 3, 4, 5, 6],
        [1, 2, 3, 7, 8, 9],
        [10, 11, 12, 13, 14, 15],
    ])
    groups, unique = ZoRRoTrain.find_prompt_groups(input_ids, response_length=3)
    assert groups == [[0, 1], [2]]
    assert unique.tolist() == [[1, 2, 3], [10, 11, 12]]


def test_find_prompt_groups_mask_aware_non_adjacent():
    ids = torch.tensor([[0, 7, 8, 1], [9, 7, 8, 2], [0, 7, 8, 3], [0, 0, 8, 4]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1], [0, 1, 1, 1], [0, 0, 1, 1]])
    groups, _ = ZoRRoTrain.find_prompt_groups(ids, 1, attention_mask=mask)
    assert groups == [[0, 2], [1], [3]]


def _block_causal(lengths):
    """The reference API's example input: a [q, k] self-attention mask of causal blocks along the diagonal."""
    n = sum(lengths)
    mask = torch.zeros(n, n, dtype=torch.bool)
    s = 0
    for L in lengths:
        mask[s:s + L, s:s + L] = torch.ones(L, L, dtype=torch.bool).tril()
        s += L
    return mask


@pytest.mark.parametrize("shape", [(12, 12), (1, 12, 12), (1, 1, 12, 12)])
@pytest.mark.parametrize("dtype", [torch.bool, torch.int64, torch.float32])
def test_attention_mask_to_flash_attn_params_example(shape, dtype):
    """Three sequences of 5, 3 and 4 tokens as a 12 x 12 block-causal mask (the reference API's example)."""
    mask = _block_causal([5, 3, 4]).to(dtype).view(shape)
    p = ZoRRoTrain.attention_mask_to_flash_attn_params(mask)
    assert p["cu_seqlens_q"].tolist() == [0, 5, 8, 12] and p["cu_seqlens_q"].dtype == torch.int32
    assert p["cu_seqlens_k"].tolist() == [0, 5, 8, 12]
    assert p["max_seqlen_q"] == 5 and p["max_seqlen_k"] == 5 and p["num_sequences"] == 3


def test_attention_mask_to_flash_attn_params_padding_mask_is_explicit():
    pad = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]])
    p = ZoRRoTrain.attention_mask_to_flash_attn_params(padding_mask=pad)
    assert p["cu_seqlens_q"].tolist() == [0, 5, 8, 12] and p["num_sequences"] == 3
    # the same [n, L] tensor given as a self-attention mask is not block-causal: refused, never misread
    with pytest.raises(ValueError):
        ZoRRoTrain.attention_mask_to_flash_attn_params(pad)
    with pytest.raises(ValueError, match="exactly one"):
        ZoRRoTrain.attention_mask_to_flash_attn_params(_block_causal([2]), padding_mask=pad)
    with pytest.raises(ValueError, match="exactly one"):
        ZoRRoTrain.attention_mask_to_flash_attn_params()


def test_reconstruction_info_identity():
    info = ReconstructionInfo(a=1, b=2)
    old = id(info)
    info.update(a=2, b=3)
    assert id(info) == old and info == {"a": 2, "b": 3}
    with pytest.raises(KeyError, match="update"):
        info["a"] = 5
    info["c"] = 1  # new keys are fine


@pytest.mark.parametrize("use_unpad", [True, False])
def test_dedup_batch_round_trips(use_unpad):
    b = create_dummy_batch(7, 3, 9, 5, device="cpu", add_padding=True, shuffle=True, vocab_size=50, seed=2)
    ids, mask, pos = b["input_ids"], b["attention_mask"], b["position_ids"]
    groups, unique = ZoRRoTrain.find_prompt_groups(ids, 5, attention_mask=mask)
    d_ids, d_pos, info = ZoRRoTrain.create_deduplicated_batch(ids, pos, 5, groups, unique, attention_mask=mask,
                                                              use_unpad=use_unpad)
    plan = info["plan"]
    if use_unpad:
        assert d_ids.shape == (1, plan.T)
    else:
        assert d_ids.shape[0] == 3 and int((info["group_valid"]).sum()) == plan.T
    # ids and positions: reconstruct gives the original batch on valid tokens and zeros on pads
    full = ZoRRoTrain.reconstruct_sequences(d_ids, info)
    assert (full == ids * mask).all()
    full_pos = ZoRRoTrain.reconstruct_sequences(d_pos, info)
    assert (full_pos[mask.bool()] == pos[mask.bool()]).all()
    # hidden-state-like values with a trailing dim: dedup(reconstruct(x)) == x
    x = torch.randn(*d_ids.shape, 4, dtype=torch.float64) * (d_ids != 0).unsqueeze(-1)
    back = ZoRRoTrain.deduplicate_sequences(ZoRRoTrain.reconstruct_sequences(x, info), info)
    if use_unpad:
        assert torch.equal(back, x)
    else:
        assert torch.equal(back[info["group_valid"]], x[info["group_valid"]])
    # responses: packed order -> original order gives the valid response tokens row by row
    packed = ZoRRoTrain.extract_unpadded_responses_from_deduped_packed_ids(d_ids, info)
    orig = ZoRRoTrain.responses_in_orig_sample_order(packed, info)
    assert orig.tolist() == b["responses"][mask[:, -5:].bool()].tolist()
    # offset=-1: the predicting rows; row b's first response token is predicted by its prompt's last token
    pred = ZoRRoTrain.responses_in_orig_sample_order(
        ZoRRoTrain.extract_unpadded_responses_from_deduped_packed_ids(d_ids, info, offset=-1), info)
    prev = torch.cat([ids[:, -6:-5], ids[:, -5:-1]], 1)[mask[:, -5:].bool()]
    assert pred.tolist() == prev.tolist()


def test_create_deduplicated_batch_rejects_wrong_groups():
    ids = torch.tensor([[1, 2, 3, 4], [1, 2, 5, 6], [7, 2, 8, 9]])
    groups, unique = ZoRRoTrain.find_prompt_groups(ids, 2)
    with pytest.raises(ValueError, match="prompt_groups"):
        ZoRRoTrain.create_deduplicated_batch(ids, None, 2, [[0], [1], [2]], unique)
    with pytest.raises(ValueError, match="offset"):
        _, _, info = ZoRRoTrain.create_deduplicated_batch(ids, None, 2, groups, unique, use_unpad=True)
        ZoRRoTrain.extract_unpadded_responses_from_deduped_packed_ids(torch.zeros(1, info["plan"].T), info, 1)


def _loss_per_token(lp, old, adv, ref, clip, coef):
    """Independent scalar loop of the same PPO + k3 definition."""
    n = len(lp)
    pg, kl = 0.0, 0.0
    for i in range(n):
        r = torch.exp(lp[i] - old[i])
        pg = pg + torch.maximum(-adv[i] * r, -adv[i] * torch.clamp(r, 1 - clip, 1 + clip))
        d = ref[i] - lp[i]
        kl = kl + torch.exp(d) - d - 1
    return pg / n + coef * kl / n


def test_packed_ppo_policy_loss_matches_scalar_definition():
    g = torch.Generator().manual_seed(0)
    lp = (-torch.rand(23, generator=g, dtype=torch.float64) * 3).requires_grad_(True)
    old = lp.detach() + 0.3 * torch.randn(23, generator=g, dtype=torch.float64)
    adv = torch.randn(23, generator=g, dtype=torch.float64)
    ref = lp.detach() + 0.2 * torch.randn(23, generator=g, dtype=torch.float64)
    loss, metrics = packed_ppo_policy_loss(lp, old, adv, ref, clip_ratio=0.2, kl_loss_coef=0.1)
    expect = _loss_per_token(lp, old, adv, ref, 0.2, 0.1)
    assert abs(loss.item() - expect.item()) <= 1e-14
    (ga,) = torch.autograd.grad(loss, lp)
    (gb,) = torch.autograd.grad(expect, lp)
    assert (ga - gb).abs().max().item() <= 1e-14
    assert metrics["actor/policy_loss"] == pytest.approx(loss.item(), abs=0)
    assert 0.0 < metrics["actor/pg_clipfrac"] < 1.0
    with pytest.raises(ValueError, match="old_log_prob"):
        packed_ppo_policy_loss(lp, old[:3], adv)
    with pytest.raises(ValueError, match="at least one"):
        packed_ppo_policy_loss(lp[:0], old[:0], adv[:0])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_qwen3")
    tiny_model("qwen3", exact_norms=False).save_pretrained(d)
    return str(d)


def _actor(model_dir, **kw):
    actor = DeduplicatedActor(model_dir, device="cpu", dtype=torch.float64, **kw)
    exact_fp64_norms(actor.model)
    return actor


@pytest.mark.parametrize("attn,split,mode", [("sdpa", True, "none"), ("eager", True, "memory"),
                                             ("sdpa", False, "compute")])
def test_actor_forward_and_backward_match_ordinary(model_dir, attn, split, mode):
    actor = _actor(model_dir, attn_implementation=attn, use_split_attention=split, logits_optimization=mode)
    ref = tiny_model("qwen3")  # same seed -> same weights as the saved model
    b = create_dummy_batch(8, 2, 16, 6, device="cpu", include_training_fields=True, add_padding=True, shuffle=True,
                           vocab_size=128, seed=4)
    actor.eval()
    with torch.no_grad():
        out = actor.forward(b, temperature=0.7, calculate_entropy=True)
        lp_ref, ent_ref = ordinary_logprobs(ref, b["input_ids"], b["attention_mask"], 6, temperature=0.7,
                                            calculate_entropy=True)
    assert out.logprobs.shape == (int(b["attention_mask"][:, -6:].sum()),)
    assert (out.logprobs - lp_ref).abs().max().item() <= 1e-9
    assert (out.entropy - ent_ref).abs().max().item() <= 1e-9
    # training step: same loss definition on the ordinary model
    actor.train()
    ref.train()
    metrics = actor.compute_policy_loss_and_backward(b, temperature=0.7, gradient_accumulation=2)
    lp_t, _ = ordinary_logprobs(ref, b["input_ids"], b["attention_mask"], 6, temperature=0.7)
    valid = b["attention_mask"][:, -6:].bool()
    sel = b["response_mask"][valid].bool()
    pick = lambda k: b[k][valid][sel]  # noqa: E731
    loss, _ = packed_ppo_policy_loss(lp_t[sel], pick("old_log_probs"), pick("advantages"), pick("ref_log_prob"))
    (loss / 2).backward()
    assert abs(metrics["actor/policy_loss"] - loss.item()) <= 1e-9
    assert metrics["zorro/dedup_ratio"] > 1.0
    err, name = max_rel_grad_error(grads_of(ref), grads_of(actor.model))
    assert err <= 1e-9, name


def test_actor_chunks_by_max_token_len_and_reuses_patcher(model_dir):
    actor = _actor(model_dir, attn_implementation="sdpa")
    ref = tiny_model("qwen3")
    actor.eval()
    patcher = actor.patch(response_len=6, rollout_n=4, temperature=1.0)
    assert actor.patch(response_len=3, rollout_n=2, temperature=0.5) is patcher  # installed once
    # micro-batches of different shapes through the same patcher, then a forced split into group chunks
    for (B, G, P, R), max_tok in [((8, 2, 16, 6), 4096), ((5, 3, 7, 3), 4096), ((9, 3, 12, 5), 30)]:
        actor.max_token_len = max_tok
        b = create_dummy_batch(B, G, P, R, device="cpu", add_padding=True, shuffle=True, vocab_size=128, seed=B)
        with torch.no_grad():
            out = actor.forward(b, temperature=0.9, calculate_entropy=True)
            lp_ref, ent_ref = ordinary_logprobs(ref, b["input_ids"], b["attention_mask"], R, temperature=0.9,
                                                calculate_entropy=True)
        assert (out.logprobs - lp_ref).abs().max().item() <= 1e-9
        assert (out.entropy - ent_ref).abs().max().item() <= 1e-9
    assert actor.patch(6, 4, 1.0).stats(out.plan)["zorro/split_groups"] == 3.0  # 3 groups of 3 < rollout_n=4


@pytest.mark.parametrize("kwargs,match", [
    (dict(device="cpu", logits_optimization="fast"), "logits_optimization"),
    (dict(device="cpu", attn_implementation="magic"), "attn_implementation"),
    (dict(device="cpu", attn_implementation="flash_attention_2"), "needs a CUDA device"),
    (dict(device="cpu", attention_backend="flash"), "needs a CUDA device"),
    (dict(device="cpu", attention_backend="flash_attention_2"), "attention backend: expected one of"),
    (dict(device="cpu", world_size=0), "world_size"),
    (dict(device="cpu", world_size=2), "torch.distributed"),
    (dict(device="cpu", max_token_len=0), "max_token_len"),
    (dict(device="cpu", dtype=torch.int64), "dtype"),
])
def test_actor_bad_arguments(model_dir, kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        DeduplicatedActor(model_dir, **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_actor_cuda_without_gpu(model_dir):
    with pytest.raises(ValueError, match="CUDA is not available"):
        DeduplicatedActor(model_dir, device="cuda")


def test_actor_bad_batches(model_dir):
    actor = _actor(model_dir)
    b = create_dummy_batch(4, 2, 8, 3, device="cpu", include_training_fields=True, vocab_size=128)
    with pytest.raises(TypeError, match="micro_batch"):
        actor.forward([b["input_ids"]])
    with pytest.raises(ValueError, match="missing keys"):
        actor.forward({"input_ids": b["input_ids"]})
    with pytest.raises(ValueError, match="responses"):
        actor.forward({**b, "responses": b["responses"][:3]})
    with pytest.raises(ValueError, match="smaller than the sequence width"):
        actor.forward({**b, "responses": b["input_ids"]})
    with pytest.raises(ValueError, match="response_mask"):
        actor.forward({**b, "response_mask": b["response_mask"][:, :2]})
    with pytest.raises(ValueError, match="missing keys"):
        actor.compute_policy_loss_and_backward({k: v for k, v in b.items() if k != "advantages"})
    with pytest.raises(ValueError, match="gradient_accumulation"):
        actor.compute_policy_loss_and_backward(b, gradient_accumulation=0)
    with pytest.raises(ValueError, match="rollout_n"):
        actor.patch(3, 0, 1.0)
    with pytest.raises(ValueError, match="temperature"):
        actor.patch(3, 2, 0.0)


def test_zorro_attention_without_plan_and_with_mask(model_dir):
    actor = _actor(model_dir)
    actor.patch(3, 2, 1.0)
    ids = torch.randint(1, 100, (2, 6))
    with pytest.raises(ValueError, match="without zorro's step context"):
        actor.model(input_ids=ids)
    b = create_dummy_batch(4, 2, 8, 3, device="cpu", vocab_size=128)
    plan = actor._patcher.plan(b)
    out = zorro_step(actor.model, plan)  # the same model works through the plan
    assert out[0].shape == (plan.N,)


def test_model_without_interface_dispatch_is_refused():
    """A model whose attention does not dispatch through ALL_ATTENTION_FUNCTIONS fails the install probe."""
    from zorro_verl.integrations.transformers import install_zorro, is_installed

    model = tiny_model("qwen3")
    layer = model.model.layers[0].self_attn

    def private_attention(hidden_states, position_embeddings, attention_mask=None, **kwargs):
        # A layer computing its own mixing (here: none) instead of calling the attention interface.
        return layer.o_proj(layer.v_proj(hidden_states).repeat(1, 1, 2)), None

    layer.forward = private_attention
    with pytest.raises(ValueError, match="called 1 times"):
        install_zorro(model)
    assert not is_installed(model)  # restored after the failed probe


def test_layer_types_zorro_does_not_handle_are_refused():
    from zorro_verl.integrations.transformers import install_zorro

    model = tiny_model("qwen3")
    model.config.layer_types = ["heavily_compressed_attention", "full_attention"]  # a type zorro does not handle
    with pytest.raises(ValueError, match="heavily_compressed_attention"):
        install_zorro(model)


def test_actor_attention_backend_keyword_selects_any_registered_backend(model_dir):
    """Every registered backend is selectable (here those that train on CPU); it overrides attn_implementation."""
    from zorro_verl.attention import available_backends

    ref = tiny_model("qwen3")
    b = create_dummy_batch(6, 2, 9, 4, device="cpu", add_padding=True, shuffle=True, vocab_size=128, seed=4)
    lp_ref, _ = ordinary_logprobs(ref, b["input_ids"], b["attention_mask"], 4)
    for name in available_backends("cpu"):
        actor = _actor(model_dir, attn_implementation="eager", attention_backend=name)
        assert actor.backend == name
        with torch.no_grad():
            assert (actor.forward(b).logprobs - lp_ref).abs().max().item() <= 1e-9
    wrapped = DeduplicatedActor.from_model(tiny_model("qwen3"), attention_backend="standard")
    assert wrapped.backend == "standard"


@pytest.mark.parametrize("max_tok", [4096, 40])
def test_actor_prefix_sharing_matches_ordinary(model_dir, max_tok):
    """``sharing="prefix"`` (keyword only): an agentic batch (shared system prompt, multi-turn samples with masked
    tool tokens) matches the ordinary forward and training step; a small budget chunks by whole trie clusters."""
    from zorro_verl.testing import batch_from_rows, multi_turn_rows, shared_system_rows

    actor = _actor(model_dir, attn_implementation="sdpa", max_token_len=max_tok, sharing="prefix", min_shared_len=3)
    ref = tiny_model("qwen3")
    rows = shared_system_rows(2, 3, system_len=8, question_len=3, response_len=4, vocab_size=128, seed=5)
    turns, masks = multi_turn_rows(3, first_prompt_len=4, turn_len=3, observation_len=2, vocab_size=128, seed=6)
    b = batch_from_rows(rows + turns, response_masks=[[1] * 4] * len(rows) + masks, include_training_fields=True)
    R = b["responses"].shape[1]
    actor.eval()
    with torch.no_grad():
        out = actor.forward(b, temperature=0.8, calculate_entropy=True)
        lp_ref, ent_ref = ordinary_logprobs(ref, b["input_ids"], b["attention_mask"], R, temperature=0.8,
                                            calculate_entropy=True)
    assert out.plan.tree is not None
    assert (out.logprobs - lp_ref).abs().max().item() <= 1e-9
    assert (out.entropy - ent_ref).abs().max().item() <= 1e-9
    actor.train()
    ref.train()
    metrics = actor.compute_policy_loss_and_backward(b, temperature=0.8)
    lp_t, _ = ordinary_logprobs(ref, b["input_ids"], b["attention_mask"], R, temperature=0.8)
    valid = b["attention_mask"][:, -R:].bool()
    sel = b["response_mask"][valid].bool()
    pick = lambda k: b[k][valid][sel]  # noqa: E731
    loss, _ = packed_ppo_policy_loss(lp_t[sel], pick("old_log_probs"), pick("advantages"), pick("ref_log_prob"))
    loss.backward()
    assert abs(metrics["actor/policy_loss"] - loss.item()) <= 1e-9
    assert metrics["zorro/tree_depth"] >= 3 and metrics["zorro/dedup_ratio"] > 1.5
    err, name = max_rel_grad_error(grads_of(ref), grads_of(actor.model))
    assert err <= 1e-8, name


def test_actor_sharing_arguments(model_dir):
    with pytest.raises(ValueError, match="sharing: expected one of"):
        DeduplicatedActor(model_dir, device="cpu", sharing="tree")
    with pytest.raises(ValueError, match="only used with sharing='prefix'"):
        DeduplicatedActor(model_dir, device="cpu", min_shared_len=8)
    with pytest.raises(ValueError, match="min_shared_len"):
        DeduplicatedActor.from_model(tiny_model("qwen3"), sharing="prefix", min_shared_len=0)


def test_actor_loads_a_model_without_sdpa_and_matches_ordinary(tmp_path):
    """gpt-oss has no SDPA path: the actor loads it with eager attention (replaced by zorro) and its log-probs equal
    the ordinary per-row forward (sliding / full layers, sinks, MoE; fp64)."""
    from zorro_verl.testing import tiny_window_model

    tiny_window_model("gpt_oss", exact=False, window=4).save_pretrained(tmp_path)
    actor = _actor(str(tmp_path), attn_implementation="eager")
    assert actor.model.config._attn_implementation == "eager"
    actor.model.set_experts_implementation("eager")  # fp64: grouped_mm has no fp64 kernel
    b = create_dummy_batch(6, 2, 9, 4, device="cpu", add_padding=True, shuffle=True, vocab_size=128, seed=2)
    with torch.no_grad():
        lp_ref, _ = ordinary_logprobs(tiny_window_model("gpt_oss", window=4), b["input_ids"], b["attention_mask"], 4)
        assert (actor.forward(b).logprobs - lp_ref).abs().max().item() <= 1e-12
    assert actor.model.zorro_features["sinks"] == [0, 1, 2]


def _ppo_step_ordinary(ref, b, R, temperature):
    """The API's training step on the ordinary model: the same PPO + KL loss over ``response_mask``, backward."""
    lp, _ = ordinary_logprobs(ref, b["input_ids"], b["attention_mask"], R, temperature=temperature)
    valid = b["attention_mask"][:, -R:].bool()
    sel = b["response_mask"][valid].bool()
    pick = lambda k: b[k][valid][sel]  # noqa: E731
    loss, _ = packed_ppo_policy_loss(lp[sel], pick("old_log_probs"), pick("advantages"), pick("ref_log_prob"))
    loss.backward()
    return loss


def test_actor_loads_a_peft_adapter_trainable_and_trains_as_ordinary(model_dir, tmp_path):
    """A PEFT LoRA adapter directory loads onto its base as a trainable ``PeftModel`` (the LoRA parameters require
    grad, the base's do not, as PEFT trains an adapter; transformers' own adapter loading attaches it frozen, and the
    step's backward found nothing to train); one training step equals the ordinary forward's on an identical
    ``PeftModel`` (loss and every LoRA gradient, fp64, 1e-9)."""
    import json
    import shutil

    from transformers import AutoModelForCausalLM

    from tests.support.lora import wrap_lora

    targets = ["q_proj", "v_proj", "down_proj"]
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)  # the adapter names it as its base
    wrap_lora(base, targets, seed=5).save_pretrained(tmp_path / "adapter")
    actor = _actor(str(tmp_path / "adapter"), attn_implementation="sdpa")
    params = dict(actor.model.named_parameters())
    lora = {n for n in params if ".lora_A." in n or ".lora_B." in n}
    assert len(lora) == 2 * 2 * len(targets)  # A and B per target per layer
    assert {n for n, p in params.items() if p.requires_grad} == lora  # base frozen
    ref = wrap_lora(tiny_model("qwen3"), targets, seed=5)  # same seeds -> the saved adapter on the same base
    b = create_dummy_batch(8, 2, 16, 6, device="cpu", include_training_fields=True, add_padding=True, shuffle=True,
                           vocab_size=128, seed=4)
    actor.train()
    ref.train()
    metrics = actor.compute_policy_loss_and_backward(b, temperature=0.7)
    loss = _ppo_step_ordinary(ref, b, 6, 0.7)
    assert abs(metrics["actor/policy_loss"] - loss.item()) <= 1e-9
    ref_grads = grads_of(ref)
    assert set(ref_grads) == lora and all(g.abs().max() > 0 for g in ref_grads.values())
    err, name = max_rel_grad_error(ref_grads, grads_of(actor.model))
    assert err <= 1e-9, name
    # an adapter on top of another adapter: transformers would attach the inner one frozen under the outer one
    shutil.copytree(tmp_path / "adapter", tmp_path / "stacked")
    cfg_path = tmp_path / "stacked" / "adapter_config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "base_model_name_or_path":
                                    str(tmp_path / "adapter")}))
    with pytest.raises(ValueError, match="holds an adapter itself"):
        DeduplicatedActor(str(tmp_path / "stacked"), device="cpu", dtype=torch.float64)
    # an adapter saved from a model built from a config names no base
    wrap_lora(tiny_model("qwen3"), targets).save_pretrained(tmp_path / "baseless")
    with pytest.raises(ValueError, match="names no base_model_name_or_path"):
        DeduplicatedActor(str(tmp_path / "baseless"), device="cpu", dtype=torch.float64)


def test_memory_mode_names_a_lora_head_by_its_qualified_class():
    """A PEFT LoRA layer on the head (``peft.tuners.lora.layer.Linear``, not an ``nn.Linear``): the memory mode
    refuses it naming the qualified class, why, and what runs it."""
    from tests.support.lora import wrap_lora

    actor = DeduplicatedActor.from_model(wrap_lora(tiny_model("qwen3"), ["q_proj", "lm_head"]),
                                         logits_optimization="memory")
    b = create_dummy_batch(4, 2, 8, 3, device="cpu", vocab_size=128)
    with pytest.raises(ValueError, match=r"got peft\.tuners\.lora\.layer\.Linear, whose forward would be skipped"
                                         r".*'none' or 'compute'.*out of the adapter's target_modules"):
        actor.forward(b)


@pytest.mark.parametrize("kind", ["PromptTuningConfig", "PrefixTuningConfig", "PromptEncoderConfig"])
def test_actor_refuses_peft_prompt_learning_before_any_forward(kind):
    """Prompt tuning / prefix tuning / p-tuning add virtual tokens to every row (prepended embeddings or per-layer
    prefix keys / values) that zorro's packed row has no place for: refused by name before the model runs (it
    used to fail inside the install probe's attention on a query longer than the plan)."""
    import peft

    model = peft.get_peft_model(tiny_model("qwen3"), getattr(peft, kind)(task_type="CAUSAL_LM", num_virtual_tokens=3))
    calls = []
    model.get_input_embeddings().register_forward_hook(lambda *a: calls.append(1))
    actor = DeduplicatedActor.from_model(model)
    b = create_dummy_batch(4, 2, 8, 3, device="cpu", vocab_size=128)
    with pytest.raises(ValueError, match=r"PEFT prompt learning \(adapter 'default' is P.*num_virtual_tokens=3.*not "
                                         r"supported by zorro; use a LoRA adapter or set zorro off"):
        actor.forward(b)
    assert calls == []
