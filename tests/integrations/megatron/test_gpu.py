"""Zorro on megatron-core's GPTModel with Transformer Engine on a GPU (docs/design/megatron.md, testing.md): the TE
layer spec (TE's core attention, wrapped by zorro's subclass: non-zorro calls run TE unchanged) and TE's fused RoPE
(``apply_rope_fusion=True``) fed zorro's per-token table ``[Tp, 1, 1, D]``.

Relative rule: an fp32 TE model with unfused RoPE running megatron's ordinary forward (right-padded rows, causal) is
the reference; the ordinary bf16 forward (fused RoPE) gives the baseline error; zorro in bf16 (fused RoPE, the
settings' flash backend) must stay within 2x that error for log-probs and 3x for gradients (relative Frobenius
norms). A per-token RoPE indexed wrongly would be off by far more. Skipped without CUDA, megatron-core or
Transformer Engine (scripts/gpu_check.sh runs it where they are installed).
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.gpu

pytest.importorskip("megatron.core", reason="megatron-core is not installed here")
pytest.importorskip("transformer_engine", reason="Transformer Engine is not installed here")

VOCAB = 512


def _init():
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29731")
        dist.init_process_group("nccl", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(0)


def _model(dtype: torch.dtype, fused_rope: bool, zorro: bool):
    import torch.nn.functional as F
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from zorro_verl.integrations.megatron import install_zorro_megatron

    cfg = TransformerConfig(num_layers=2, hidden_size=256, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=512, normalization="RMSNorm", gated_linear_unit=True,
                            activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                            params_dtype=dtype, bf16=dtype == torch.bfloat16, pipeline_dtype=dtype,
                            apply_rope_fusion=fused_rope, use_cpu_initialization=True)
    torch.manual_seed(0)
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_with_transformer_engine_spec(),
                     vocab_size=VOCAB, max_sequence_length=512, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False).cuda()
    if zorro:
        install_zorro_megatron(model)
    return model


def _batch():
    from zorro_verl.testing import create_dummy_batch

    b = create_dummy_batch(8, 2, 96, 32, device="cuda", add_padding=True, shuffle=True, seed=2, vocab_size=VOCAB)
    return b["input_ids"], b["attention_mask"], b["responses"].shape[1]


def _ordinary(model, ids, am, R):
    """megatron's ordinary forward on the right-padded rows; response log-probs ``[N]`` fp32."""
    Pw = ids.shape[1] - R
    rows = []
    for b in range(ids.shape[0]):
        p, r = int(am[b, :Pw].sum()), int(am[b, Pw:].sum())
        rows.append((torch.cat([ids[b, Pw - p:Pw], ids[b, Pw:Pw + r]]), p, r))
    L = max(len(t) for t, _, _ in rows)
    batch = torch.zeros(len(rows), L, dtype=torch.long, device="cuda")
    for b, (t, _, _) in enumerate(rows):
        batch[b, :len(t)] = t
    logits = model(input_ids=batch, position_ids=torch.arange(L, device="cuda")[None].expand(len(rows), L),
                   attention_mask=None)
    out = []
    for b, (t, p, r) in enumerate(rows):
        if r:
            lp = torch.log_softmax(logits[b, p - 1:p + r - 1].float(), -1)
            out.append(lp.gather(-1, t[p:p + r, None])[:, 0])
    return torch.cat(out)


def _grads(model):
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def _rel(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("sharing", ["prompt", "prefix"])
def test_te_spec_fused_rope_relative_rule(sharing):
    from zorro_verl.integrations.megatron import zorro_gpt_step
    from zorro_verl.integrations.verl.settings import resolve_attention_backend
    from zorro_verl.packing import build_plan

    _init()
    ids, am, R = _batch()
    ref = _model(torch.float32, fused_rope=False, zorro=False)
    lp_ref = _ordinary(ref, ids, am, R)
    lp_ref.sum().backward()
    g_ref = _grads(ref)
    base = _model(torch.bfloat16, fused_rope=True, zorro=False)
    lp_base = _ordinary(base, ids, am, R)
    lp_base.sum().backward()
    g_base = _grads(base)
    z = _model(torch.bfloat16, fused_rope=True, zorro=True)
    plan = build_plan(ids, am, R, sharing=sharing, **({"min_shared_len": 8} if sharing == "prefix" else {}))
    lp, _ = zorro_gpt_step(z, plan, backend=resolve_attention_backend("auto", "cuda"))
    lp.float().sum().backward()
    g = _grads(z)
    e_lp, e_lp_base = _rel(lp, lp_ref), _rel(lp_base, lp_ref)
    e_g = max(_rel(g[n], g_ref[n]) for n in g_ref)
    e_g_base = max(_rel(g_base[n], g_ref[n]) for n in g_ref)
    print(f"megatron TE bf16 fused RoPE ({sharing}): zorro log-probs {e_lp:.2e} (ordinary {e_lp_base:.2e}), "
          f"grads {e_g:.2e} (ordinary {e_g_base:.2e})")
    assert e_lp <= 2 * e_lp_base, f"log-probs: {e_lp:.2e} > 2 x {e_lp_base:.2e}"
    assert e_g <= 3 * e_g_base, f"grads: {e_g:.2e} > 3 x {e_g_base:.2e}"


def _hybrid_model(dtype: torch.dtype, zorro: bool):
    """A Qwen3.5-shaped hybrid (a gated delta-net layer, then gated attention) on megatron's real block spec
    (``get_transformer_block_with_experimental_attention_variant_spec``: Transformer Engine modules) with
    flash-linear-attention's kernels: what the CPU stand-ins (tests/support/megatron_gdn.py) replace."""
    import torch.nn.functional as F
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_transformer_block_with_experimental_attention_variant_spec,
    )
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from zorro_verl.integrations.megatron import install_zorro_megatron

    cfg = TransformerConfig(num_layers=2, hidden_size=256, num_attention_heads=4, num_query_groups=2, kv_channels=64,
                            ffn_hidden_size=512, normalization="RMSNorm", gated_linear_unit=True,
                            activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                            params_dtype=dtype, bf16=dtype == torch.bfloat16, pipeline_dtype=dtype,
                            use_cpu_initialization=True, qk_layernorm=True, layernorm_zero_centered_gamma=True,
                            attention_output_gate=True, experimental_attention_variant="gated_delta_net",
                            linear_attention_freq=[1, 0], linear_conv_kernel_dim=4, linear_key_head_dim=32,
                            linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4)
    torch.manual_seed(0)
    model = GPTModel(config=cfg, transformer_layer_spec=get_transformer_block_with_experimental_attention_variant_spec(
        cfg), vocab_size=VOCAB, max_sequence_length=512, position_embedding_type="rope", rotary_percent=0.5,
        share_embeddings_and_output_weights=False).cuda()
    if zorro:
        install_zorro_megatron(model)
    return model


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("sharing", ["prompt", "prefix"])
def test_hybrid_te_spec_fla_relative_rule(sharing):
    """Qwen3.5-shaped hybrid on the real (TE + FLA) spec: zorro's packed gated delta rule (FLA's kernel varlen, one
    initial state per response) in bf16 within the relative rule of the ordinary bf16 forward, against fp32."""
    pytest.importorskip("fla", reason="flash-linear-attention is not installed here")
    from zorro_verl.integrations.megatron import zorro_gpt_step
    from zorro_verl.integrations.verl.settings import resolve_attention_backend
    from zorro_verl.packing import build_plan

    _init()
    ids, am, R = _batch()
    ref = _hybrid_model(torch.float32, zorro=False)
    lp_ref = _ordinary(ref, ids, am, R)
    lp_ref.sum().backward()
    g_ref = _grads(ref)
    base = _hybrid_model(torch.bfloat16, zorro=False)
    lp_base = _ordinary(base, ids, am, R)
    lp_base.sum().backward()
    g_base = _grads(base)
    z = _hybrid_model(torch.bfloat16, zorro=True)
    plan = build_plan(ids, am, R, sharing=sharing, **({"min_shared_len": 8} if sharing == "prefix" else {}))
    lp, _ = zorro_gpt_step(z, plan, backend=resolve_attention_backend("auto", "cuda"))
    lp.float().sum().backward()
    g = _grads(z)
    e_lp, e_lp_base = _rel(lp, lp_ref), _rel(lp_base, lp_ref)
    e_g = max(_rel(g[n], g_ref[n]) for n in g_ref)
    e_g_base = max(_rel(g_base[n], g_ref[n]) for n in g_ref)
    print(f"megatron hybrid TE + FLA bf16 ({sharing}): zorro log-probs {e_lp:.2e} (ordinary {e_lp_base:.2e}), "
          f"grads {e_g:.2e} (ordinary {e_g_base:.2e})")
    assert e_lp <= 2 * e_lp_base, f"log-probs: {e_lp:.2e} > 2 x {e_lp_base:.2e}"
    assert e_g <= 3 * e_g_base, f"grads: {e_g:.2e} > 3 x {e_g_base:.2e}"
