"""DeepSeek-V3 (multi-latent attention: q / k heads of ``qk_nope_head_dim + qk_rope_head_dim`` = 16 + 8, v heads
of 12; a sigmoid-routed MoE layer with a shared expert) through zorro vs the ordinary per-row forward, fp64 on CPU:
log-probs, entropy, the PPO loss and every parameter gradient (docs/design/megatron.md, multi-latent
attention: ``attend`` takes a value head dim of its own). transformers' router computes its logits in fp32 (``.type(
torch.float32)``); here each router instance runs them in the weight's dtype (fp64), as for Megatron's MoE tests, so
the router gradients, which deduplication sums in another order, are compared in fp64 too."""

import pytest
import torch
import torch.nn.functional as F

from tests.integrations.transformers.test_families import ABS_TOL, REL_TOL
from tests.integrations.transformers.test_step import batch_of, run_pair

WORST: dict = {}


def _fp64_router(router):
    def forward(hidden_states):  # transformers' DeepseekV3TopkRouter.forward without its fp32 casts
        return F.linear(hidden_states.view(-1, router.config.hidden_size), router.weight)

    router.forward = forward


def _deepseek_v3(kind, **_):
    import transformers

    from zorro_verl.testing import exact_fp64_norms, model_from_config

    cfg = transformers.DeepseekV3Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=20, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=12, max_position_embeddings=4096, attention_dropout=0.0)
    model = model_from_config(cfg, torch.float64, 0, "sdpa")
    exact_fp64_norms(model)
    routers = [m for m in model.modules() if type(m).__name__ == "DeepseekV3TopkRouter"]
    assert len(routers) == 1
    for r in routers:
        _fp64_router(r)
    return model


@pytest.mark.parametrize("backend", ["sdpa", "eager", "standard", "flash_copyfree"])
def test_deepseek_v3_exact(backend):
    r = run_pair("deepseek_v3", backend, "none", 0.9, batch=batch_of(seed=31), make=_deepseek_v3)
    WORST[backend] = r
    assert r["plan"].T < r["plan"].ordinary_tokens
    assert r["lp_err"] <= ABS_TOL and r["ent_err"] <= ABS_TOL and r["loss_err"] <= ABS_TOL, r
    assert r["grad_err"][0] <= REL_TOL, r
