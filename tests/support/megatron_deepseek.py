"""A tiny DeepSeek-V3 checkpoint through verl's Megatron engine on the CPU (vanilla mbridge 0.15.1's
``DeepseekV3Bridge`` on megatron-core 0.19.2 and transformers 5), for the multi-latent-attention engine test
(tests/integrations/megatron/test_engine_mla.py; never shipped). On top of :func:`megatron_engines.setup_process`:

* D1: mbridge reads ``hf_config.rope_theta``; transformers 5 keeps it in ``rope_parameters`` (given back as an
  attribute of the loaded config);
* D2: mbridge passes ``max_position_embeddings`` to ``MLATransformerConfig``, which megatron-core 0.19 calls
  ``original_max_position_embeddings``;
* D3: its safetensor reader is bf16-only (DeepSeek's fp8-dequantising one); fp32 engines read with mbridge's plain one;
* D4: the local spec's names: MLA's q / kv norms are ``q_layernorm`` / ``kv_layernorm`` (TE fuses them into the up
  projections, mbridge's names); the experts' local names are megatron_engines' V9, for every mbridge MoE bridge;
* D5: megatron's local ``DotProductAttention`` with MLA's ``k_channels`` / ``v_channels`` (P9,
  :func:`megatron_cpu.mla_dot_product_attention`) in the decoder block spec, with ``kv_channels = v_head_dim``
  (:data:`OVERRIDE`).

:data:`OVERRIDE` also turns off the MoE statistics over the micro-batch's tokens (the expert-bias updates and the
auxiliary loss: zorro weighs them by multiplicity, compared at the model level in test_moe.py) and what needs
Transformer Engine / a GPU (grouped GEMM, shared-expert overlap); routing itself (sigmoid scores, top-2 of 4, one
shared expert, the first layer dense) stays.
"""

from __future__ import annotations

import torch

__all__ = ["patch_deepseek_bridge", "save_tiny_deepseek_v3", "OVERRIDE", "V_HEAD_DIM"]

V_HEAD_DIM = 12
#: ``override_transformer_config`` keys for the DeepSeek-V3 engines (see the module docstring)
OVERRIDE = {"moe_grouped_gemm": False, "moe_router_enable_expert_bias": False, "moe_aux_loss_coeff": 0.0,
            "moe_shared_expert_overlap": False, "kv_channels": V_HEAD_DIM}
_DONE = False


def patch_deepseek_bridge() -> None:
    """D1-D5, once per process (after :func:`megatron_engines.setup_process`)."""
    global _DONE
    if _DONE:
        return
    from mbridge.core import llm_bridge
    from mbridge.core.bridge import Bridge
    from mbridge.models.deepseek_v3 import DeepseekV3Bridge

    from tests.support.megatron_cpu import with_mla_core_attention

    build_config = DeepseekV3Bridge._build_config

    def _build_config(self):  # D1
        hf = self.hf_config
        if not hasattr(hf, "rope_theta"):
            object.__setattr__(hf, "rope_theta", hf.rope_parameters["rope_theta"])
        return build_config(self)

    base_config = DeepseekV3Bridge._build_base_config

    def _build_base_config(self, **kw):  # D2
        if "max_position_embeddings" in kw:
            kw["original_max_position_embeddings"] = kw.pop("max_position_embeddings")
        return base_config(self, **kw)

    DeepseekV3Bridge._build_config = _build_config
    DeepseekV3Bridge._build_base_config = _build_base_config
    DeepseekV3Bridge._get_safetensor_io = Bridge._get_safetensor_io  # D3
    DeepseekV3Bridge._ATTENTION_MAPPING = {  # D4
        **DeepseekV3Bridge._ATTENTION_MAPPING,
        "self_attention.q_layernorm.weight": ["model.layers.{layer_number}.self_attn.q_a_layernorm.weight"],
        "self_attention.kv_layernorm.weight": ["model.layers.{layer_number}.self_attn.kv_a_layernorm.weight"]}
    block_spec = llm_bridge.get_gpt_decoder_block_spec  # megatron_engines' V5 (the local spec)

    def _block_spec(config, use_transformer_engine=True, **kw):  # D5
        return with_mla_core_attention(block_spec(config, use_transformer_engine, **kw), config)

    llm_bridge.get_gpt_decoder_block_spec = _block_spec
    _DONE = True


def save_tiny_deepseek_v3(path: str, vocab: int) -> str:
    """A tiny DeepSeek-V3 checkpoint at ``path`` from seed 0: 2 layers (the first dense, the second MoE: 4 routed
    experts, top 2, one shared), hidden 64, 4 heads, MLA with ``q_lora_rank`` 24, ``kv_lora_rank`` 20, q / k heads
    of 16 + 8 (decoupled RoPE), v heads of :data:`V_HEAD_DIM`; untied head."""
    import transformers

    cfg = transformers.DeepseekV3Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=20, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=V_HEAD_DIM, max_position_embeddings=256, tie_word_embeddings=False,
        rms_norm_eps=1e-6, rope_theta=10000.0)
    cfg.architectures = ["DeepseekV3ForCausalLM"]
    torch.manual_seed(0)
    transformers.DeepseekV3ForCausalLM(cfg).save_pretrained(path)
    return path
