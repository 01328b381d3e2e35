"""The FLOP model against brute-force counts: linear weights of real modules, attended pairs of the plan's dense
mask, and docs/design/math.md's linear ideal."""

import pytest
import torch

from zorro_verl.bench.flops import (
    attention_pairs,
    flop_model,
    linear_attention_flops_per_token,
    linear_flops_per_token,
    mlp_flops_per_token,
)
from zorro_verl.bench.models import MODEL_SHAPES, build_model
from zorro_verl.packing import build_plan
from zorro_verl.testing import create_dummy_batch, dense_mask


def _config():
    from transformers import Qwen3Config

    return Qwen3Config(**MODEL_SHAPES["quick"])


def test_linear_flops_per_token_equal_twice_the_linear_weights_of_a_layer():
    from transformers import AutoModelForCausalLM

    cfg = _config()
    cfg.num_hidden_layers = 1
    model = AutoModelForCausalLM.from_config(cfg)
    layer = model.model.layers[0]
    weights = sum(m.weight.numel() for m in layer.modules() if isinstance(m, torch.nn.Linear))
    assert linear_flops_per_token(cfg) == 2 * weights


@pytest.mark.parametrize("ragged,shuffle", [(False, False), (True, True)])
def test_flop_model_counts_tokens_and_attended_pairs(ragged, shuffle):
    """zorro's pairs = ones in the plan's dense [T, T] mask; baseline pairs = causal pairs of every padded row."""
    cfg = _config()
    b = create_dummy_batch(6, 2, 12, 5, device="cpu", add_padding=ragged, shuffle=shuffle, seed=4)
    plan = build_plan(b["input_ids"], b["attention_mask"], 5)
    S = b["input_ids"].shape[1]
    fl = flop_model(cfg, plan.row_prompt_lens, plan.response_lens, plan.row_group, S)
    L, H, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
    per_pair = 4 * cfg.num_attention_heads * cfg.head_dim
    lin = linear_flops_per_token(cfg)
    z_pairs = int(dense_mask(plan).sum())
    base_pairs = 6 * int(torch.ones(S, S).tril().sum())
    head = 2 * H * V * plan.N
    assert fl["zorro_tokens"] == plan.T and fl["N"] == plan.N
    assert fl["zorro"] == L * (lin * plan.T + per_pair * z_pairs) + head
    assert fl["baseline"] == L * (lin * 6 * S + per_pair * base_pairs) + head
    assert fl["baseline_full"] == fl["baseline"] - head + 2 * H * V * 6 * S
    assert attention_pairs(plan.row_prompt_lens, plan.response_lens, plan.row_group, S) == (base_pairs, z_pairs)


def test_linear_part_of_the_ideal_matches_design_examples():
    """docs/design/math.md: linear ideal B(P+R) / (G P + B R) — the token counts of the FLOP model reproduce it."""
    for (B, G, P, R), expect in (((8, 2, 4096, 512), 3.0), ((16, 1, 8192, 1024), 6.0), ((16, 4, 8192, 1024), 3.0),
                                 ((16, 16, 8192, 1024), 1.0)):
        row_group = torch.arange(B) * G // B
        fl = flop_model(_config(), torch.full((B,), P), torch.full((B,), R), row_group, P + R)
        assert fl["baseline_tokens"] / fl["zorro_tokens"] == pytest.approx(expect, rel=1e-12)


def test_hybrid_flop_model_counts_real_modules():
    """The config-based FLOP terms of the hybrid shape equal 2 x the weights the real modules multiply by."""
    model = build_model("hybrid-quick", torch.float32, "cpu")
    cfg = model.config
    kinds = {t: next(layer for layer, lt in zip(model.model.layers, cfg.layer_types) if lt == t)
             for t in ("linear_attention", "full_attention")}

    def linear_weights(module):
        return sum(m.weight.numel() for m in module.modules() if isinstance(m, torch.nn.Linear))

    lin_layer, full_layer = kinds["linear_attention"], kinds["full_attention"]
    state = 6 * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
    assert linear_attention_flops_per_token(cfg) == \
        2 * (linear_weights(lin_layer.linear_attn) + lin_layer.linear_attn.conv1d.weight.numel()) + state
    assert mlp_flops_per_token(cfg) == 2 * linear_weights(full_layer.mlp)
    assert linear_flops_per_token(cfg) == 2 * (linear_weights(full_layer.self_attn) + linear_weights(full_layer.mlp))
    # linear-attention layers have no quadratic term: with only such layers the ideal would be the token ratio
    B, G, P, R = 8, 2, 64, 16
    p_len, r_len = torch.full((B,), P), torch.full((B,), R)
    row_group = torch.arange(B) * G // B
    fl = flop_model(cfg, p_len, r_len, row_group, P + R)
    assert fl["baseline_tokens"] == B * (P + R) and fl["zorro_tokens"] == G * P + B * R
    assert fl["baseline"] / fl["zorro"] < (B * (P + R)) / (G * P + B * R) + 1e-9  # the head is the same on both


def test_lora_flops_count_every_adapter_and_the_frozen_backward():
    """LoRA: the adapters' FLOPs equal 2 x the weights of every lora_A / lora_B of the real PEFT model (all-linear:
    the 7 projections of each layer, not the head); forward-only ratios include them; the fwd_bwd terms count the
    frozen base linears and head once more (input gradients) and attention and adapters twice more, by hand."""
    from zorro_verl.integrations.transformers.lora import apply_lora, lora_flops_per_token

    cfg = _config()
    model = build_model("quick", torch.float32, "cpu")
    apply_lora(model, 8)
    ad = lora_flops_per_token(model)
    weights = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    assert ad == 2 * weights and weights == cfg.num_hidden_layers * 8 * sum(
        i + o for i, o in [(256, 256), (256, 128), (256, 128), (256, 256), (256, 768), (256, 768), (768, 256)])
    assert not any(p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)
    B, G, P, R = 8, 2, 64, 16
    p_len, r_len, row_group = torch.full((B,), P), torch.full((B,), R), torch.arange(B) * G // B
    full_ft, lora = (flop_model(cfg, p_len, r_len, row_group, P + R, a) for a in (0, ad))
    L, H, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
    lin, per_pair = linear_flops_per_token(cfg) * L, 4 * cfg.num_attention_heads * cfg.head_dim * L
    head = 2 * H * V * B * R
    pairs = attention_pairs(p_len, r_len, row_group, P + R)
    for key, tokens, n_pairs in (("baseline", B * (P + R), pairs[0]), ("zorro", G * P + B * R, pairs[1])):
        assert lora[key] == full_ft[key] + ad * tokens
        assert full_ft[key + "_fwd_bwd"] == 3 * full_ft[key]
        assert lora[key + "_fwd_bwd"] == 2 * (lin * tokens + head) + 3 * (per_pair * n_pairs + ad * tokens)
    # the adapters and the frozen backward move the ideal, but only a little: the token ratio still dominates
    ideal = full_ft["baseline"] / full_ft["zorro"]
    assert lora["baseline_fwd_bwd"] / lora["zorro_fwd_bwd"] == pytest.approx(ideal, rel=0.05)
