"""Test and demo helpers: tiny models built from a config (no download), GRPO-shaped batches, the ordinary
per-row reference forward, and error measures. Importing this module imports transformers lazily.
"""

from __future__ import annotations

import types
from typing import Optional

import torch

__all__ = [
    "create_dummy_batch",
    "tiny_config",
    "tiny_model",
    "exact_fp64_norms",
    "ordinary_logprobs",
    "ordinary_logprobs_padded",
    "max_rel_grad_error",
    "grads_of",
]


def create_dummy_batch(
    batch_size: int = 8,
    num_unique_prompts: int = 2,
    prompt_len: int = 4096,
    response_len: int = 512,
    device: str = "cuda",
    include_training_fields: bool = False,
    add_padding: bool = False,
    vocab_size: int = 1000,
    seed: int = 0,
    shuffle: bool = False,
) -> dict[str, torch.Tensor]:
    """A GRPO-shaped micro-batch in verl's layout.

    ``num_unique_prompts`` prompts, each repeated ``batch_size / num_unique_prompts`` times (the remainder goes to
    the first prompts). With ``add_padding`` prompts have different valid lengths (left pad) and responses end
    early (right pad); one response in every group of >= 3 has length 1 and the last row of the batch may
    have an empty response. With ``shuffle`` siblings are not adjacent.

    Returns a dict:
        ``input_ids [B, P+R] int64``, ``attention_mask [B, P+R] int64``, ``position_ids [B, P+R] int64``,
        ``responses [B, R] int64``, ``response_mask [B, R] int64``; with ``include_training_fields`` also
        ``old_log_probs``, ``advantages``, ``ref_log_prob`` ``[B, R] float32`` (zeros on pads).
    """
    for name, v in (("batch_size", batch_size), ("num_unique_prompts", num_unique_prompts),
                    ("prompt_len", prompt_len), ("response_len", response_len)):
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "response_len" else 1):
            raise ValueError(f"{name}: expected a positive int, got {v!r}.")
    if num_unique_prompts > batch_size:
        raise ValueError(f"num_unique_prompts: expected <= batch_size ({batch_size}), got {num_unique_prompts}.")
    gen = torch.Generator().manual_seed(seed)
    B, G, P, R = batch_size, num_unique_prompts, prompt_len, response_len
    group = torch.arange(B) * G // B  # contiguous groups of near-equal size
    prompts = torch.randint(1, vocab_size, (G, P), generator=gen)
    p_len = torch.full((G,), P)
    r_len = torch.full((B,), R)
    if add_padding:
        p_len = torch.randint(max(1, P // 2), P + 1, (G,), generator=gen)
        p_len[0] = P
        r_len = torch.randint(max(1, R // 2), R + 1, (B,), generator=gen) if R > 0 else r_len
        if R > 0:
            r_len[0] = R
            for g in range(G):
                rows = (group == g).nonzero().flatten()
                if rows.numel() >= 3:
                    r_len[rows[1]] = 1
            if B >= 3 and (group == group[-1]).sum() >= 2:
                r_len[-1] = 0
    input_ids = torch.zeros(B, P + R, dtype=torch.long)
    attention_mask = torch.zeros(B, P + R, dtype=torch.long)
    responses = torch.randint(1, vocab_size, (B, R), generator=gen)
    for b in range(B):
        g = int(group[b])
        p, r = int(p_len[g]), int(r_len[b])
        input_ids[b, P - p:P] = prompts[g, P - p:]
        attention_mask[b, P - p:P + r] = 1
    responses = responses * attention_mask[:, P:]
    input_ids[:, P:] = responses
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0) * attention_mask
    # verl keeps counting positions on the right pad; the valid tokens are what matter.
    response_mask = attention_mask[:, P:].clone()
    batch = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "responses": responses,
        "response_mask": response_mask,
    }
    if include_training_fields:
        m = response_mask.float()
        batch["old_log_probs"] = (-torch.rand(B, R, generator=gen) * 2 - 0.1) * m
        adv = torch.randn(G, generator=gen)[group]
        batch["advantages"] = (adv[:, None] + 0.1 * torch.randn(B, R, generator=gen)) * m
        batch["ref_log_prob"] = (-torch.rand(B, R, generator=gen) * 2 - 0.1) * m
    if shuffle:
        perm = torch.randperm(B, generator=gen)
        batch = {k: v[perm] for k, v in batch.items()}
    return {k: v.to(device) for k, v in batch.items()}


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


def _model_from_config(cfg, dtype: torch.dtype, seed: int, attn_implementation: str):
    """``*ForCausalLM`` from ``cfg`` with the given attention, deterministic for ``seed``."""
    from transformers import AutoModelForCausalLM

    cfg._attn_implementation = attn_implementation
    if hasattr(cfg, "num_experts") and dtype == torch.float64:
        cfg._experts_implementation = "eager"  # grouped_mm has no fp64 kernel
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype)


def tiny_model(kind: str = "qwen3", *, dtype: torch.dtype = torch.float64, seed: int = 0,
               attn_implementation: str = "sdpa", exact_norms: bool = True, **cfg_kwargs):
    """A randomly initialised ``*ForCausalLM`` from :func:`tiny_config`; deterministic for a given ``seed``.

    With ``exact_norms`` (default) RMSNorm modules keep fp64 in fp64 (see :func:`exact_fp64_norms`).
    """
    model = _model_from_config(tiny_config(kind, **cfg_kwargs), dtype, seed, attn_implementation)
    if exact_norms:
        exact_fp64_norms(model)
    return model


def _exact_rmsnorm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    dt = torch.float64 if hidden_states.dtype == torch.float64 else torch.float32
    x = hidden_states.to(dt)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * x.to(hidden_states.dtype)


def _exact_topk_router_forward(self, hidden_states: torch.Tensor):
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = torch.nn.functional.linear(hidden_states, self.weight)
    dt = torch.float64 if router_logits.dtype == torch.float64 else torch.float32
    probs = torch.softmax(router_logits.to(dt), dim=-1)
    top, idx = torch.topk(probs, self.top_k, dim=-1)
    if self.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return router_logits, top.to(router_logits.dtype), idx


def exact_fp64_norms(model) -> None:
    """Make RMSNorm (``weight * x / rms(x)``) and top-k MoE router instances keep fp64 in fp64.

    transformers' RMSNorm and Qwen3-MoE router cast to fp32 whatever the input dtype; in fp64 that rounding,
    differently summed by the ordinary and the deduplicated backward, leaves ~1e-8 relative gradient differences
    that are not zorro's. The swap is per instance (test oracle only) and changes nothing for fp32/bf16.
    """
    for mod in model.modules():
        w = getattr(mod, "weight", None)
        if hasattr(mod, "variance_epsilon") and isinstance(w, torch.Tensor) and w.dim() == 1:
            mod.forward = types.MethodType(_exact_rmsnorm_forward, mod)
        elif all(hasattr(mod, a) for a in ("top_k", "num_experts", "norm_topk_prob", "hidden_dim")) and \
                isinstance(w, torch.Tensor) and w.dim() == 2:
            mod.forward = types.MethodType(_exact_topk_router_forward, mod)


def ordinary_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_width: int, *,
                      temperature: float = 1.0, calculate_entropy: bool = False):
    """The ordinary per-row forward (the oracle): each row's valid tokens alone, full logits, log-softmax.

    Returns ``(log_probs [N], entropy [N] | None)`` over valid response tokens in original row order.
    """
    B, S = input_ids.shape
    Pw = S - response_width
    lps, ents = [], []
    for b in range(B):
        valid = attention_mask[b].bool()
        p = int(valid[:Pw].sum())
        r = int(valid[Pw:].sum())
        if r == 0:
            continue
        x = input_ids[b][valid][None]
        logits = model(input_ids=x, use_cache=False).logits[0, p - 1:p + r - 1]
        logits = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32) / temperature
        logp = torch.log_softmax(logits, -1)
        lps.append(logp.gather(-1, x[0, p:p + r, None]).squeeze(-1))
        if calculate_entropy:
            ents.append(-(logp.exp() * logp).sum(-1))
    empty = torch.zeros(0, dtype=torch.float64 if model.dtype == torch.float64 else torch.float32,
                        device=input_ids.device)
    lp = torch.cat(lps) if lps else empty
    ent = (torch.cat(ents) if ents else empty) if calculate_entropy else None
    return lp, ent


def ordinary_logprobs_padded(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                             position_ids: torch.Tensor, response_width: int, *, temperature: float = 1.0,
                             calculate_entropy: bool = False):
    """The ordinary *batched* forward as verl runs it (padded rows, attention mask, full logits) — the
    benchmark's "full logits" baseline. Returns ``[B, R]`` log-probs (and entropy)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   use_cache=False).logits
    logits = logits[:, -response_width - 1:-1]
    logits = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32) / temperature
    logp = torch.log_softmax(logits, -1)
    lp = logp.gather(-1, input_ids[:, -response_width:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1) if calculate_entropy else None
    return lp, ent


def grads_of(model) -> dict[str, torch.Tensor]:
    """``{name: grad.clone()}`` of every parameter that has a gradient."""
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def max_rel_grad_error(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor],
                       floor: Optional[float] = None) -> tuple[float, str]:
    """Largest per-tensor relative error ``max|got - ref| / max|ref|`` over all parameters, and its name.

    Every reference gradient must be present in ``got``. ``floor`` (default: the tensor's dtype eps) keeps an
    all-zero reference gradient from dividing by zero.
    """
    missing = sorted(set(ref) ^ set(got))
    if missing:
        raise AssertionError(f"gradients present in only one model: {missing[:5]}")
    worst, worst_name = 0.0, ""
    for n, g in ref.items():
        denom = max(g.abs().max().item(), floor if floor is not None else torch.finfo(g.dtype).eps)
        err = (got[n] - g).abs().max().item() / denom
        if err > worst:
            worst, worst_name = err, n
    return worst, worst_name


# ---------------------------------------------------------------------------------------------------- hybrid models
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
    model = _model_from_config(tiny_hybrid_config(kind, **cfg_kwargs), dtype, seed, attn_implementation)
    with torch.no_grad():  # random, not the zero/one init, so every parameter matters in the tests
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    if exact:
        exact_fp64_hybrid(model)
    return model


def _exact_offset_rmsnorm_forward(self, x: torch.Tensor) -> torch.Tensor:
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = x.to(dt)
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
    return (y * (1.0 + self.weight.to(dt))).type_as(x)


def _exact_gated_rmsnorm_forward(self, hidden_states: torch.Tensor, gate: Optional[torch.Tensor] = None):
    dt = torch.float64 if hidden_states.dtype == torch.float64 else torch.float32
    x = hidden_states.to(dt)
    eps = self.variance_epsilon if hasattr(self, "variance_epsilon") else self.eps  # fla's FusedRMSNormGated: eps
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    x = self.weight * x.to(hidden_states.dtype)
    return (x * torch.nn.functional.silu(gate.to(dt))).to(hidden_states.dtype)


def _exact_normalized_router_forward(self, hidden_states: torch.Tensor):
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = torch.nn.functional.linear(hidden_states, self.weight)
    dt = torch.float64 if router_logits.dtype == torch.float64 else torch.float32
    top, idx = torch.topk(torch.softmax(router_logits.to(dt), dim=-1), self.top_k, dim=-1)
    top = top / top.sum(dim=-1, keepdim=True)
    return router_logits, top.to(router_logits.dtype), idx


def exact_fp64_hybrid(model) -> None:
    """Per-instance fp64-exact swaps for hybrid models (test oracle only; fp32/bf16 behaviour unchanged).

    transformers computes these in fp32 whatever the input dtype: the ``1 + weight`` RMSNorms, the gated RMSNorm of
    the delta-net output, the MoE routers, the delta-net log-decay and the torch fallback delta-rule kernels. The
    kernels are replaced by :func:`zorro_verl.recurrent.chunk_gated_delta_rule_ref` (the same math,
    dtype-preserving), set on the instance attribute the module calls, so the ordinary forward and zorro use the
    same kernel; the delta-net forward by a written-out copy that keeps the log-decay in fp64 (as zorro does).
    """
    from zorro_verl.recurrent import chunk_gated_delta_rule_ref, recurrent_gated_delta_rule_ref

    for mod in model.modules():
        name = type(mod).__name__
        w = getattr(mod, "weight", None)
        if name.endswith("RMSNormGated"):
            mod.forward = types.MethodType(_exact_gated_rmsnorm_forward, mod)
        elif name.endswith("RMSNorm") and hasattr(mod, "eps") and isinstance(w, torch.Tensor) and w.dim() == 1:
            mod.forward = types.MethodType(_exact_offset_rmsnorm_forward, mod)
        elif name.endswith("TopKRouter") and isinstance(w, torch.Tensor) and w.dim() == 2:
            fwd = _exact_topk_router_forward if hasattr(mod, "norm_topk_prob") else _exact_normalized_router_forward
            mod.forward = types.MethodType(fwd, mod)
        if hasattr(mod, "chunk_gated_delta_rule") and hasattr(mod, "A_log"):
            mod.chunk_gated_delta_rule = chunk_gated_delta_rule_ref
            mod.recurrent_gated_delta_rule = recurrent_gated_delta_rule_ref
            mod.forward = types.MethodType(_exact_gated_deltanet_forward, mod)


def _exact_gated_deltanet_forward(self, hidden_states: torch.Tensor, cache_params=None, attention_mask=None,
                                  **kwargs) -> torch.Tensor:
    """The ordinary (one sequence per batch row) gated delta-net forward of Qwen3.5 / Qwen3-Next, written out for
    the fp64 oracle: the model's own math, with the log-decay kept in fp64 for fp64 inputs (transformers rounds
    ``a`` and ``A_log`` to fp32 there). Training forwards only: no cache, no padding mask."""
    F = torch.nn.functional
    if cache_params is not None or attention_mask is not None:
        raise ValueError("exact gated delta-net oracle: no cache and no attention_mask (run rows unpadded).")
    Bsz, L, _ = hidden_states.shape
    if hasattr(self, "in_proj_qkvz"):
        q, k, v, z, b, a = self.fix_query_key_value_ordering(self.in_proj_qkvz(hidden_states),
                                                             self.in_proj_ba(hidden_states))
        mixed = torch.cat([x.reshape(Bsz, L, -1) for x in (q, k, v)], -1)
    else:
        mixed = self.in_proj_qkv(hidden_states)
        z = self.in_proj_z(hidden_states)
        b, a = self.in_proj_b(hidden_states), self.in_proj_a(hidden_states)
    mixed = F.silu(self.conv1d(mixed.transpose(1, 2))[:, :, :L]).transpose(1, 2)  # causal: keep the first L
    q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    q = q.reshape(Bsz, L, -1, self.head_k_dim)
    k = k.reshape(Bsz, L, -1, self.head_k_dim)
    v = v.reshape(Bsz, L, -1, self.head_v_dim)
    dt = torch.float64 if a.dtype == torch.float64 else torch.float32
    g = -self.A_log.to(dt).exp() * F.softplus(a.to(dt) + self.dt_bias)
    rep = self.num_v_heads // self.num_k_heads
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    o, _ = self.chunk_gated_delta_rule(q, k, v, g=g, beta=b.sigmoid(), initial_state=None, output_final_state=False,
                                       use_qk_l2norm_in_kernel=True)
    o = self.norm(o.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
    return self.out_proj(o.reshape(Bsz, L, -1))
