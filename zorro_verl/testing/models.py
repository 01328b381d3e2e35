"""Tiny randomly initialised models built from a config (offline, no download): Qwen3 / Qwen3-MoE and the hybrid
gated delta-net families. transformers is imported inside the functions, never at import."""

from __future__ import annotations

import torch

from zorro_verl.testing.fp64 import (
    FP64_EAGER,
    exact_fp64_hybrid,
    exact_fp64_norms,
    exact_fp64_ssm,
    register_fp64_eager_attention,
)

__all__ = ["tiny_config", "tiny_model", "HYBRID_KINDS", "tiny_hybrid_config", "tiny_hybrid_model",
           "model_from_config", "WINDOW_KINDS", "tiny_window_config", "tiny_window_model", "SSM_KINDS",
           "tiny_ssm_config", "tiny_ssm_model", "MIXER_KINDS", "tiny_mixer_config", "tiny_mixer_model"]


def tiny_config(kind: str = "qwen3", *, gqa: bool = True, layers: int = 2, vocab_size: int = 128,
                hidden: int = 32, heads: int = 4, tie_word_embeddings: bool = False):
    """A small config built offline. ``kind``: ``qwen3`` or ``qwen3_moe``; ``gqa=False`` gives MHA."""
    kv = heads // 2 if gqa else heads
    common = dict(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv, head_dim=hidden // heads, max_position_embeddings=4096,
                  tie_word_embeddings=tie_word_embeddings, attention_dropout=0.0)
    if kind == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(intermediate_size=2 * hidden, **common)
    if kind == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(intermediate_size=2 * hidden, moe_intermediate_size=hidden, num_experts=4,
                              num_experts_per_tok=2, decoder_sparse_step=1, norm_topk_prob=True, **common)
    raise ValueError(f"kind: expected 'qwen3' or 'qwen3_moe', got {kind!r}.")


def model_from_config(cfg, dtype: torch.dtype, seed: int, attn_implementation: str):
    """``*ForCausalLM`` from ``cfg`` with the given attention, deterministic for ``seed`` (the shared builder of
    :func:`tiny_model` and :func:`tiny_hybrid_model`)."""
    from transformers import AutoModelForCausalLM

    cfg._attn_implementation = attn_implementation
    if (hasattr(cfg, "num_experts") or hasattr(cfg, "num_local_experts")) and dtype == torch.float64:
        cfg._experts_implementation = "eager"  # grouped_mm has no fp64 kernel
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype)


def tiny_model(kind: str = "qwen3", *, dtype: torch.dtype = torch.float64, seed: int = 0,
               attn_implementation: str = "sdpa", exact_norms: bool = True, **cfg_kwargs):
    """A randomly initialised ``*ForCausalLM`` from :func:`tiny_config`; deterministic for a given ``seed``.

    With ``exact_norms`` (default) RMSNorm modules keep fp64 in fp64 (see :func:`exact_fp64_norms`).
    """
    model = model_from_config(tiny_config(kind, **cfg_kwargs), dtype, seed, attn_implementation)
    if exact_norms:
        exact_fp64_norms(model)
    return model


def _perturb_vectors(model) -> None:
    """Random offsets on 1-D parameters (norm weights, biases, sinks, decays), not their zero/one init, so every
    parameter matters in the tests."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))


def tiny_value_model(kind: str = "qwen3", *, dtype: torch.dtype = torch.float64, seed: int = 0,
                     attn_implementation: str = "sdpa", exact_norms: bool = True):
    """A randomly initialised value model as verl's critic builds it: ``*ForTokenClassification`` with
    ``num_labels = 1`` and ``classifier_dropout = 0`` on :func:`tiny_config`'s backbone; its ``score`` head
    ``Linear(H, 1)`` is drawn with std 0.5 (not the tiny init) so that values are O(1). Deterministic for ``seed``."""
    from transformers import AutoModelForTokenClassification

    cfg = tiny_config(kind)
    cfg.num_labels, cfg.classifier_dropout = 1, 0.0
    cfg._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = AutoModelForTokenClassification.from_config(cfg, dtype=dtype)
    _perturb_vectors(model)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 0.5)
    if exact_norms:
        exact_fp64_norms(model)
    return model


#: ``kind`` names of :func:`tiny_hybrid_config`.
HYBRID_KINDS = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


def tiny_hybrid_config(kind: str = "qwen3_5", *, layer_types: tuple = ("linear_attention", "full_attention",
                                                                      "linear_attention"),
                       vocab_size: int = 128, hidden: int = 32, heads: int = 4, gqa: bool = True,
                       linear_k_heads: int = 2, linear_v_heads: int = 4, linear_head_dim: int = 8,
                       conv_kernel: int = 4):
    """A small hybrid (gated delta-net + full attention) text config built offline.

    ``kind``: ``qwen3_5`` (Qwen3.5 dense text), ``qwen3_5_moe`` (Qwen3.5 MoE text) or ``qwen3_next``. The default
    layer pattern starts and ends with linear attention; ``linear_v_heads > linear_k_heads`` exercises the key-head
    repeat of the delta rule.
    """
    common = dict(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=len(layer_types),
                  layer_types=list(layer_types), num_attention_heads=heads,
                  num_key_value_heads=heads // 2 if gqa else heads, head_dim=hidden // heads,
                  max_position_embeddings=4096, tie_word_embeddings=False, attention_dropout=0.0,
                  linear_conv_kernel_dim=conv_kernel, linear_key_head_dim=linear_head_dim,
                  linear_value_head_dim=linear_head_dim, linear_num_key_heads=linear_k_heads,
                  linear_num_value_heads=linear_v_heads)
    moe = dict(moe_intermediate_size=hidden, shared_expert_intermediate_size=hidden, num_experts=4,
               num_experts_per_tok=2)
    if kind == "qwen3_5":
        from transformers import Qwen3_5TextConfig

        return Qwen3_5TextConfig(intermediate_size=2 * hidden, **common)
    if kind == "qwen3_5_moe":
        from transformers import Qwen3_5MoeTextConfig

        return Qwen3_5MoeTextConfig(**moe, **common)
    if kind == "qwen3_next":
        from transformers import Qwen3NextConfig

        return Qwen3NextConfig(intermediate_size=2 * hidden, decoder_sparse_step=1, norm_topk_prob=True, **moe,
                               **common)
    raise ValueError(f"kind: expected one of {HYBRID_KINDS}, got {kind!r}.")


def tiny_hybrid_model(kind: str = "qwen3_5", *, dtype: torch.dtype = torch.float64, seed: int = 0,
                      attn_implementation: str = "sdpa", exact: bool = True, **cfg_kwargs):
    """A randomly initialised hybrid ``*ForCausalLM`` from :func:`tiny_hybrid_config`; deterministic per ``seed``.

    With ``exact`` (default) and fp64, :func:`exact_fp64_hybrid` makes the oracle keep fp64 end to end.
    """
    model = model_from_config(tiny_hybrid_config(kind, **cfg_kwargs), dtype, seed, attn_implementation)
    _perturb_vectors(model)
    if exact:
        exact_fp64_hybrid(model)
    return model


#: ``kind`` names of :func:`tiny_ssm_config`: state-space models (Mamba-2, then Mamba v1), pure and hybrid.
SSM_KINDS = ("mamba2", "bamba", "nemotron_h", "granitemoehybrid", "granitemoehybrid_moe", "mamba", "falcon_mamba",
             "jamba")


def tiny_ssm_config(kind: str = "bamba", *, vocab_size: int = 128, hidden: int = 32, heads: int = 4,
                    ssm_heads: int = 4, ssm_head_dim: int = 16, state: int = 8, groups: int = 2, conv_kernel: int = 4,
                    chunk: int = 8):
    """A small state-space config built offline: ``mamba2`` (two Mamba-2 layers), ``bamba`` / ``granitemoehybrid``
    (mamba, attention, mamba; Granite without routed experts, ``granitemoehybrid_moe`` with 4, top 2), ``nemotron_h``
    (mamba, attention, mlp, mamba); Mamba v1: ``mamba`` / ``falcon_mamba`` (two layers), ``jamba`` (mamba, attention,
    mamba); ``zamba2`` (mamba, hybrid, hybrid: its one shared attention block run by both hybrid layers, each with
    its own LoRA adapters, feeding their Mamba-2 layers; not in :data:`SSM_KINDS`, its own tests).
    ``ssm_heads * ssm_head_dim = 2 * hidden`` (expand 2); ``groups`` < heads exercises the B / C group repeat; a small
    ``chunk`` makes prompts and responses cross scan chunks."""
    att = dict(num_attention_heads=heads, num_key_value_heads=heads // 2, attention_dropout=0.0,
               max_position_embeddings=4096)
    common = dict(vocab_size=vocab_size, hidden_size=hidden, tie_word_embeddings=False)
    if kind == "mamba2":
        from transformers import Mamba2Config

        # residual_in_fp32=False: the default rounds the residual stream to fp32 (a no-op in fp32 / bf16 models),
        # which would cap fp64 comparisons at ~1e-8
        return Mamba2Config(num_hidden_layers=2, num_heads=ssm_heads, head_dim=ssm_head_dim, expand=2,
                            state_size=state, n_groups=groups, conv_kernel=conv_kernel, chunk_size=chunk,
                            residual_in_fp32=False, **common)
    if kind in ("mamba", "falcon_mamba"):  # Mamba v1: two layers, the scan over [2 * hidden, state] per token
        from transformers import FalconMambaConfig, MambaConfig

        cls = MambaConfig if kind == "mamba" else FalconMambaConfig
        return cls(num_hidden_layers=2, state_size=state, expand=2, conv_kernel=conv_kernel, time_step_rank=4,
                   residual_in_fp32=False, **common)  # residual_in_fp32: as for mamba2
    if kind == "jamba":  # Mamba v1 mixers with dt / B / C norms + attention (mamba, attention, mamba), no MoE
        from transformers import JambaConfig

        return JambaConfig(num_hidden_layers=3, attn_layer_period=2, attn_layer_offset=1, num_experts=1,
                           expert_layer_period=100, intermediate_size=2 * hidden, mamba_d_state=state,
                           mamba_d_conv=conv_kernel, mamba_expand=2, mamba_dt_rank=4, use_mamba_kernels=False,
                           **att, **common)
    mamba = dict(mamba_n_heads=ssm_heads, mamba_d_head=ssm_head_dim, mamba_expand=2, mamba_d_state=state,
                 mamba_n_groups=groups, mamba_d_conv=conv_kernel, mamba_chunk_size=chunk)
    if kind == "bamba":
        from transformers import BambaConfig

        return BambaConfig(num_hidden_layers=3, attn_layer_indices=[1], intermediate_size=2 * hidden, **mamba, **att,
                           **common)
    if kind in ("granitemoehybrid", "granitemoehybrid_moe"):  # the latter with 4 routed experts (top 2)
        from transformers import GraniteMoeHybridConfig

        moe = dict(num_local_experts=4, num_experts_per_tok=2) if kind.endswith("_moe") else dict(num_local_experts=0)
        return GraniteMoeHybridConfig(num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"],
                                      shared_intermediate_size=2 * hidden, intermediate_size=2 * hidden, **moe,
                                      **mamba, **att, **common)
    if kind == "nemotron_h":
        from transformers import NemotronHConfig

        # Nemotron-H's torch path is exact only within one chunk (ssm.py): a chunk longer than the test rows
        chunk = max(chunk, 32)

        return NemotronHConfig(layers_block_type=["mamba", "attention", "mlp", "mamba"], head_dim=hidden // heads,
                               intermediate_size=2 * hidden, mamba_num_heads=ssm_heads, mamba_head_dim=ssm_head_dim,
                               expand=2, ssm_state_size=state, n_groups=groups, conv_kernel=conv_kernel,
                               chunk_size=chunk, hidden_dropout=0.0, **att, **common)
    if kind == "zamba2":  # mamba, hybrid, hybrid: one shared attention block run twice, with per-layer LoRA adapters
        from transformers import Zamba2Config

        # key / value heads = query heads: transformers' Zamba2 sizes its k / v adapters for the query heads
        chunk = max(chunk, 32)  # Zamba2's torch path, as Nemotron-H's, is exact only within one chunk (ssm.py)

        return Zamba2Config(layers_block_type=["mamba", "hybrid", "hybrid"], num_hidden_layers=3, num_mem_blocks=1,
                            use_shared_attention_adapter=True, adapter_rank=4, use_mem_rope=True,
                            intermediate_size=2 * hidden, n_mamba_heads=ssm_heads, mamba_expand=2,
                            mamba_d_state=state, mamba_ngroups=groups, mamba_d_conv=conv_kernel, chunk_size=chunk,
                            use_mamba_kernels=False, **{**att, "num_key_value_heads": heads}, **common)
    if kind == "zamba":  # mamba, mamba, hybrid: multi-head Mamba v1 mixers (2 heads, a B / C each), shared attention
        from transformers import ZambaConfig

        return ZambaConfig(num_hidden_layers=3, n_mamba_heads=2, mamba_d_state=state, mamba_d_conv=conv_kernel,
                           mamba_expand=2, mamba_dt_rank=4, use_mamba_kernels=False, intermediate_size=2 * hidden,
                           **{**att, "num_key_value_heads": heads}, **common)
    if kind in ("falcon_h1", "falcon_h1_norm"):  # two hybrid layers (attention beside a Mamba-2 mixer); muP
        # multipliers away from 1 so each matters; falcon_h1_norm: its grouped gated norm, applied before the gate
        from transformers import FalconH1Config

        mult = dict(ssm_multipliers=[0.9, 1.1, 0.8, 1.2, 0.7], ssm_in_multiplier=1.3, ssm_out_multiplier=0.8,
                    attention_in_multiplier=1.2, attention_out_multiplier=0.9, key_multiplier=1.1,
                    mlp_multipliers=[0.9, 1.1], embedding_multiplier=1.5, lm_head_multiplier=0.7)
        norm = dict(mamba_rms_norm=True, mamba_norm_before_gate=True) if kind.endswith("_norm") else {}
        return FalconH1Config(num_hidden_layers=2, head_dim=hidden // heads, intermediate_size=2 * hidden,
                              mamba_d_ssm=ssm_heads * ssm_head_dim, mamba_n_heads=ssm_heads, mamba_d_head=ssm_head_dim,
                              mamba_d_state=state, mamba_n_groups=groups, mamba_d_conv=conv_kernel,
                              mamba_chunk_size=chunk, **mult, **norm, **att, **common)
    raise ValueError(f"kind: expected one of {SSM_KINDS}, 'zamba', 'zamba2', 'falcon_h1', 'falcon_h1_norm'; got "
                     f"{kind!r}.")


def tiny_ssm_model(kind: str = "bamba", *, dtype: torch.dtype = torch.float64, seed: int = 0,
                   attn_implementation: str = "sdpa", exact: bool = True, **cfg_kwargs):
    """A randomly initialised state-space ``*ForCausalLM`` from :func:`tiny_ssm_config`; deterministic per ``seed``.
    With ``exact`` (default) and fp64, :func:`exact_fp64_ssm` makes the oracle keep fp64 end to end."""
    if kind in ("mamba2", "mamba", "falcon_mamba"):
        attn_implementation = "eager"  # no attention layers; transformers refuses sdpa for them
    model = model_from_config(tiny_ssm_config(kind, **cfg_kwargs), dtype, seed, attn_implementation)
    if kind == "zamba" and dtype == torch.float64:  # Zamba keeps A_log in fp32 (_keep_in_fp32): fp64 here, so
        from zorro_verl.testing.fp64 import to_fp64  # its gradient does not round to fp32

        model = to_fp64(model)
    if kind == "zamba2":  # one shared block for both hybrid layers, as a checkpoint ties them (_tied_weights_keys;
        # a model built from its config keeps two copies, each using one of its two adapters)
        model.model.layers[2].shared_transformer = model.model.layers[1].shared_transformer
    _perturb_vectors(model)
    if exact and dtype == torch.float64:
        exact_fp64_ssm(model)
    return model


#: ``kind`` names of :func:`tiny_window_config`: model families with sliding-window layers, sinks or soft-capping.
WINDOW_KINDS = ("gpt_oss", "gemma2", "gemma3", "mistral")


def tiny_window_config(kind: str, *, window: int = 5, layers: int = 3, vocab_size: int = 128, hidden: int = 32,
                       heads: int = 4, gqa: bool = True, attn_softcap: float = 1.0, final_softcap: float = 3.0):
    """A small config of a family whose attention is more than causal softmax, built offline.

    * ``gpt_oss``: sliding / full layers alternating (starting with sliding), per-head sink logits, a 4-expert
      top-2 MoE with biases;
    * ``gemma2``: sliding / full alternating, attention logit soft-cap ``attn_softcap``, final logit soft-cap
      ``final_softcap`` (small values, so ``tanh`` is far from the identity at these scales), query_pre_attn_scalar
      != head_dim (scaling is not ``D ** -0.5``);
    * ``gemma3``: Gemma 3's text model, sliding layers with a full layer last, q/k norms, two RoPE bases;
    * ``mistral``: one ``sliding_window`` for every layer (no layer types).
    """
    kv = heads // 2 if gqa else heads
    alternating = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    common = dict(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv, head_dim=hidden // heads, max_position_embeddings=4096,
                  tie_word_embeddings=False, attention_dropout=0.0, sliding_window=window)
    if kind == "gpt_oss":
        from transformers import GptOssConfig

        return GptOssConfig(intermediate_size=hidden, num_local_experts=4, num_experts_per_tok=2,
                            layer_types=alternating, **common)
    if kind == "gemma2":
        from transformers import Gemma2Config

        return Gemma2Config(intermediate_size=2 * hidden, layer_types=alternating, attn_logit_softcapping=attn_softcap,
                            final_logit_softcapping=final_softcap, query_pre_attn_scalar=hidden // heads * 2,
                            **common)
    if kind == "gemma3":
        from transformers import Gemma3TextConfig

        types = ["sliding_attention"] * (layers - 1) + ["full_attention"]
        return Gemma3TextConfig(intermediate_size=2 * hidden, layer_types=types, query_pre_attn_scalar=hidden // heads,
                                **common)
    if kind == "mistral":
        from transformers import MistralConfig

        return MistralConfig(intermediate_size=2 * hidden, **common)
    raise ValueError(f"kind: expected one of {WINDOW_KINDS}, got {kind!r}.")


def tiny_window_model(kind: str, *, dtype: torch.dtype = torch.float64, seed: int = 0,
                      attn_implementation: str | None = None, exact: bool = True, **cfg_kwargs):
    """A randomly initialised ``*ForCausalLM`` of :func:`tiny_window_config`; deterministic per ``seed``.

    ``attn_implementation`` None: the fp64-exact eager oracle attention (``"fp64_eager"``, transformers' own eager
    mask incl. the sliding window) for fp64, ``"eager"`` otherwise (gpt-oss has no SDPA path; Gemma 2's SDPA path
    has no soft-cap). With ``exact`` and fp64, norms keep fp64 (:func:`exact_fp64_norms`). 1-D parameters (norm
    weights, sinks, biases) get a random offset so every one of them matters.
    """
    if attn_implementation is None:
        attn_implementation = FP64_EAGER if dtype == torch.float64 else "eager"
    if attn_implementation == FP64_EAGER:
        register_fp64_eager_attention()
    model = model_from_config(tiny_window_config(kind, **cfg_kwargs), dtype, seed, attn_implementation)
    _perturb_vectors(model)
    if exact:
        exact_fp64_norms(model)
    return model


def tiny_llama4_config(*, layer_types: str = "default", chunk: int = 4, floor_scale: int = 2, layers: int = 4,
                       vocab_size: int = 128, moe: bool = True, **kwargs):
    """A tiny Llama 4 text config (``Llama4ForCausalLM``). ``layer_types="default"``: Llama 4's own pattern (RoPE
    layers ``chunked_attention`` with ``attention_chunk_size = chunk``, every 4th layer NoPE ``full_attention`` with
    the query temperature); ``"full"``: every layer ``full_attention`` (the NoPE layers keep their temperature).
    ``floor_scale`` small (default 2) so the temperature varies within a few tokens (real models: 8192); weights
    drawn with std 0.2 (``initializer_range``) so attention is far from uniform and each rule shows. ``moe``:
    every layer a mixture of 2 experts (top-1, a shared expert), else dense MLPs."""
    from transformers import Llama4TextConfig

    extra = {"layer_types": ["full_attention"] * layers} if layer_types == "full" else {}
    if not moe:
        extra["moe_layers"] = []
    return Llama4TextConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=32, intermediate_size_mlp=64,
                            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_local_experts=2, num_experts_per_tok=1, attention_chunk_size=chunk,
                            floor_scale=floor_scale, attn_scale=0.5, attention_dropout=0.0,
                            initializer_range=kwargs.pop("initializer_range", 0.2), **extra, **kwargs)


def tiny_llama4_model(*, dtype: torch.dtype = torch.float64, seed: int = 0, attn_implementation: str = "sdpa",
                      **cfg_kwargs):
    """A randomly initialised ``Llama4ForCausalLM`` of :func:`tiny_llama4_config`; in fp64 with Llama 4's fp32
    casts (norms, router, rotary) kept in fp64 (:func:`~zorro_verl.testing.fp64.exact_fp64_llama4`)."""
    from zorro_verl.testing.fp64 import exact_fp64_llama4

    model = model_from_config(tiny_llama4_config(**cfg_kwargs), dtype, seed, attn_implementation)
    _perturb_vectors(model)
    if dtype == torch.float64:
        exact_fp64_llama4(model)
    return model


#: ``kind`` names of :func:`tiny_mixer_config`: hybrids whose other sequence mixers are short convs (LFM2), lightning
#: attention (MiniMax) or OLMo-hybrid's gated delta-net layout.
MIXER_KINDS = ("lfm2", "lfm2_moe", "minimax", "olmo_hybrid")


def tiny_mixer_config(kind: str, *, vocab_size: int = 128, hidden: int = 32, heads: int = 4, conv_kernel: int = 3,
                      block_size: int = 4, linear_k_heads: int = 2, linear_v_heads: int = 4, linear_head_dim: int = 8):
    """A small config, three layers (mixer, full attention, mixer), built offline:

    * ``lfm2`` / ``lfm2_moe``: ``conv`` layers (short gated conv of kernel ``conv_kernel``, with bias for ``lfm2``);
      LFM2-MoE with one dense layer first, then 4-expert top-2 MoE;
    * ``minimax``: lightning-attention ``linear_attention`` layers (``block_size`` small, so rows cross blocks), a
      4-expert top-2 MoE;
    * ``olmo_hybrid``: OLMo-hybrid's gated delta-net (a conv per projection, ``allow_neg_eigval``), ``linear_v_heads >
      linear_k_heads`` exercises the key-head repeat.
    """
    att = dict(vocab_size=vocab_size, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=heads // 2,
               max_position_embeddings=4096, tie_word_embeddings=False, attention_dropout=0.0, num_hidden_layers=3)
    if kind in ("lfm2", "lfm2_moe"):
        types = ["conv", "full_attention", "conv"]
        if kind == "lfm2":
            from transformers import Lfm2Config

            return Lfm2Config(layer_types=types, intermediate_size=2 * hidden, block_auto_adjust_ff_dim=False,
                              conv_L_cache=conv_kernel, conv_bias=True, **att)
        from transformers import Lfm2MoeConfig

        return Lfm2MoeConfig(layer_types=types, intermediate_size=2 * hidden, moe_intermediate_size=hidden,
                             num_experts=4, num_experts_per_tok=2, num_dense_layers=1, conv_L_cache=conv_kernel,
                             **att)
    types = ["linear_attention", "full_attention", "linear_attention"]
    if kind == "minimax":
        from transformers import MiniMaxConfig

        return MiniMaxConfig(layer_types=types, intermediate_size=hidden, num_local_experts=4, num_experts_per_tok=2,
                             block_size=block_size, head_dim=hidden // heads, **att)
    if kind == "olmo_hybrid":
        from transformers import OlmoHybridConfig

        return OlmoHybridConfig(layer_types=types, intermediate_size=2 * hidden, linear_num_key_heads=linear_k_heads,
                                linear_num_value_heads=linear_v_heads, linear_key_head_dim=linear_head_dim,
                                linear_value_head_dim=linear_head_dim, linear_conv_kernel_dim=conv_kernel + 1,
                                pad_token_id=0, eos_token_id=1, **att)
    raise ValueError(f"kind: expected one of {MIXER_KINDS}, got {kind!r}.")


def tiny_mixer_model(kind: str, *, dtype: torch.dtype = torch.float64, seed: int = 0,
                     attn_implementation: str = "sdpa", exact: bool = True, **cfg_kwargs):
    """A randomly initialised ``*ForCausalLM`` of :func:`tiny_mixer_config`; deterministic per ``seed``. With
    ``exact`` and fp64, the norms, routers and delta-net decays keep fp64 (:func:`exact_fp64_norms`,
    :func:`exact_fp64_hybrid`)."""
    model = model_from_config(tiny_mixer_config(kind, **cfg_kwargs), dtype, seed, attn_implementation)
    # OLMo-hybrid creates A_log in fp32 whatever the model dtype: an fp32 gradient, summed in a different order by
    # the ordinary and the deduplicated backward, would differ by fp32 rounding (~1e-7)
    model.to(dtype)
    _perturb_vectors(model)
    if exact and dtype == torch.float64:
        exact_fp64_norms(model)
        exact_fp64_hybrid(model)
    return model
