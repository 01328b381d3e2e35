"""fp64-exact per-instance forwards for the test oracle (fp32 / bf16 / fp16 behaviour unchanged).

transformers computes RMSNorms, MoE routers and the gated delta-net log-decay in fp32 whatever the input dtype. In
fp64 that rounding, summed in a different order by the ordinary and the deduplicated backward, leaves ~1e-8 relative
gradient differences that are not zorro's. The swaps here replace ``forward`` on module *instances* (never a class),
so only the test models are affected. transformers is imported only inside :func:`register_fp64_eager_attention`.
"""

from __future__ import annotations

import types
from typing import Optional

import torch

__all__ = ["exact_fp64_norms", "exact_fp64_hybrid", "exact_fp64_ssm", "exact_fp64_llama4", "FP64_EAGER",
           "register_fp64_eager_attention", "KeepFp64", "to_fp64"]


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """fp64 stays fp64; everything else is computed in fp32, as transformers does."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _exact_rmsnorm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """``weight * x / rms(x)`` (Qwen3 RMSNorm). hidden_states: ``[..., hidden]``, output in its dtype."""
    x = hidden_states.to(_compute_dtype(hidden_states))
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * x.to(hidden_states.dtype)


def _exact_offset_rmsnorm_forward(self, x: torch.Tensor) -> torch.Tensor:
    """``(1 + weight) * x / rms(x)`` (Qwen3.5 / Qwen3-Next RMSNorm). x: ``[..., hidden]``, output in its dtype."""
    dt = _compute_dtype(x)
    y = x.to(dt)
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
    return (y * (1.0 + self.weight.to(dt))).type_as(x)


def _exact_gated_rmsnorm_forward(self, hidden_states: torch.Tensor, gate: Optional[torch.Tensor] = None):
    """``weight * x / rms(x) * silu(gate)`` of the delta-net output. hidden_states, gate: ``[N, Dv]``."""
    dt = _compute_dtype(hidden_states)
    x = hidden_states.to(dt)
    eps = self.variance_epsilon if hasattr(self, "variance_epsilon") else self.eps  # fla's FusedRMSNormGated: eps
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    x = self.weight * x.to(hidden_states.dtype)
    return (x * torch.nn.functional.silu(gate.to(dt))).to(hidden_states.dtype)


def _exact_topk_router_forward(self, hidden_states: torch.Tensor):
    """Qwen3-MoE / Qwen3-Next top-k router: ``(logits [N, E], weights [N, k], experts [N, k] int64)``."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = torch.nn.functional.linear(hidden_states, self.weight)
    probs = torch.softmax(router_logits.to(_compute_dtype(router_logits)), dim=-1)
    top, idx = torch.topk(probs, self.top_k, dim=-1)
    if self.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return router_logits, top.to(router_logits.dtype), idx


def _exact_normalized_router_forward(self, hidden_states: torch.Tensor):
    """Qwen3.5-MoE router (always renormalises the top-k weights); same outputs as the top-k router."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = torch.nn.functional.linear(hidden_states, self.weight)
    top, idx = torch.topk(torch.softmax(router_logits.to(_compute_dtype(router_logits)), dim=-1), self.top_k, dim=-1)
    top = top / top.sum(dim=-1, keepdim=True)
    return router_logits, top.to(router_logits.dtype), idx


def _exact_gated_deltanet_forward(self, hidden_states: torch.Tensor, cache_params=None, attention_mask=None,
                                  **kwargs) -> torch.Tensor:
    """The ordinary (one sequence per batch row) gated delta-net forward of Qwen3.5 / Qwen3-Next / OLMo-hybrid for
    the fp64 oracle: the model's own math (OLMo-hybrid's conv modules called as the model calls them), with the
    log-decay kept in fp64 for fp64 inputs (transformers rounds ``a`` and ``A_log`` to fp32 there). Training
    forwards only: no cache, no padding mask.

    Args:
        hidden_states: ``[Bsz, L, hidden]``, one unpadded sequence per row.

    Returns:
        ``[Bsz, L, hidden]`` in the input dtype.
    """
    # Lazy: keeps `import zorro_verl.testing` light. The token-wise projections and the log-decay are zorro's own
    # (public) transcriptions of the model, so the oracle and zorro cannot drift apart there; the sequence mixing
    # (causal conv per row, the delta rule over each whole row) is what the oracle checks and stays written out.
    from zorro_verl.integrations.transformers.hybrid import (
        deltanet_beta,
        deltanet_output,
        gated_deltanet_projections,
        log_decay,
    )

    F = torch.nn.functional
    if cache_params is not None or attention_mask is not None:
        raise ValueError("exact gated delta-net oracle: got a cache or an attention_mask; expected neither (run "
                         "each row unpadded with use_cache=False).")
    Bsz, L, _ = hidden_states.shape
    # gated_deltanet_projections takes one row [1, T, hidden]; the projections are token-wise, so all rows go
    # through as one row of Bsz * L tokens (for Bsz = 1, as the ordinary per-row oracle runs, nothing changes).
    mixed, z, b, a = gated_deltanet_projections(self, hidden_states.reshape(1, Bsz * L, -1))
    mixed = mixed.reshape(Bsz, L, -1)  # [Bsz, L, C]
    b, a = b.reshape(Bsz, L, -1), a.reshape(Bsz, L, -1)  # [Bsz, L, Hv]
    q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    if hasattr(self, "conv1d"):
        mixed = F.silu(self.conv1d(mixed.transpose(1, 2))[:, :, :L]).transpose(1, 2)  # causal per row: first L
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    else:  # OLMo-hybrid: the family's own conv module per projection (causal, silu)
        q, k, v = (conv(x)[0] for conv, x in zip((self.q_conv1d, self.k_conv1d, self.v_conv1d), (q, k, v)))
    q = q.reshape(Bsz, L, -1, self.head_k_dim)
    k = k.reshape(Bsz, L, -1, self.head_k_dim)
    v = v.reshape(Bsz, L, -1, self.head_v_dim)
    g = log_decay(self, a)  # [Bsz, L, Hv], fp64 for fp64 inputs
    rep = self.num_v_heads // self.num_k_heads
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    o, _ = self.chunk_gated_delta_rule(q, k, v, g=g, beta=deltanet_beta(self, b), initial_state=None,
                                       output_final_state=False, use_qk_l2norm_in_kernel=True)
    return deltanet_output(self, o.reshape(-1, self.head_v_dim), z, Bsz * L).reshape(Bsz, L, -1)


def exact_fp64_norms(model) -> None:
    """Make RMSNorm (``weight * x / rms(x)``; Gemma's ``(1 + weight) * x / rms(x)``) and top-k MoE router
    instances keep fp64 in fp64.

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
        elif type(mod).__name__.startswith("Gemma") and type(mod).__name__.endswith("RMSNorm") and \
                hasattr(mod, "eps") and isinstance(w, torch.Tensor) and w.dim() == 1:
            mod.forward = types.MethodType(_exact_offset_rmsnorm_forward, mod)  # Gemma: (1 + weight) * x / rms(x)


def _exact_llama4_rmsnorm_forward(self, x: torch.Tensor) -> torch.Tensor:
    """Llama 4's RMSNorm ``weight * x / rms(x)`` (and its weightless q/k L2 norm), fp64 kept."""
    y = x.to(_compute_dtype(x))
    y = (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)
    return y * self.weight if getattr(self, "weight", None) is not None else y


def _exact_llama4_router_forward(self, hidden_states: torch.Tensor):
    """Llama 4's router (top-k logits, sigmoid scores), the sigmoid in fp64 for fp64 inputs."""
    logits = torch.nn.functional.linear(hidden_states, self.weight, self.bias)
    top_value, top_index = torch.topk(logits, self.top_k, dim=1)
    scores = torch.full_like(logits, float("-inf")).scatter_(1, top_index, top_value)
    return torch.sigmoid(scores.to(_compute_dtype(scores))).to(scores.dtype), logits


def _exact_llama4_rotary(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor):
    """Llama 4's complex rotary embedding with fp64 queries / keys kept in complex128."""
    dt = _compute_dtype(xq)
    xq_ = torch.view_as_complex(xq.to(dt).reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.to(dt).reshape(*xk.shape[:-1], -1, 2))
    xq_out = torch.view_as_real(xq_ * freqs_cis[:, :, None, :]).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis[:, :, None, :]).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def exact_fp64_llama4(model) -> None:
    """Per-instance fp64-exact swaps for Llama 4 text models (test oracle only; fp32/bf16 behaviour unchanged):
    its RMSNorm, q/k L2 norm and router sigmoid cast to fp32 whatever the input dtype, and its rotary embedding
    multiplies in complex64 (``xq.float()``). The rotary function is module-level in transformers, so each attention
    instance gets a forward that calls :func:`_exact_llama4_rotary` through the module's globals swapped for the
    call. Both the ordinary model and zorro's copy get the same swaps."""
    import transformers.models.llama4.modeling_llama4 as ml4

    for mod in model.modules():
        name = type(mod).__name__
        if name in ("Llama4TextRMSNorm", "Llama4TextL2Norm"):
            mod.forward = types.MethodType(_exact_llama4_rmsnorm_forward, mod)
        elif name == "Llama4Router":
            mod.forward = types.MethodType(_exact_llama4_router_forward, mod)
        elif name == "Llama4TextAttention":
            mod.forward = types.MethodType(_with_exact_rotary(ml4.Llama4TextAttention.forward, ml4), mod)


def _with_exact_rotary(forward, module):
    """``forward`` with ``module.apply_rotary_emb`` swapped for :func:`_exact_llama4_rotary` during the call."""

    def call(self, *args, **kwargs):
        saved = module.apply_rotary_emb
        module.apply_rotary_emb = _exact_llama4_rotary
        try:
            return forward(self, *args, **kwargs)
        finally:
            module.apply_rotary_emb = saved

    return call


def exact_fp64_hybrid(model) -> None:
    """Per-instance fp64-exact swaps for hybrid models (test oracle only; fp32/bf16 behaviour unchanged).

    transformers computes these in fp32 whatever the input dtype: the ``1 + weight`` RMSNorms, the gated RMSNorm of
    the delta-net output, the MoE routers, the delta-net log-decay and the torch fallback delta-rule kernels (and
    a MiniMax lightning attention cast from fp32 keeps fp32-rounded decay buffers: recomputed from its slopes). The
    kernels are replaced by :func:`zorro_verl.recurrent.chunk_gated_delta_rule_ref` (the same math,
    dtype-preserving), set on the instance attribute the module calls, so the ordinary forward and zorro use the
    same kernel; the delta-net forward by :func:`_exact_gated_deltanet_forward`, which keeps the log-decay in fp64
    (as zorro does).
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
        if hasattr(mod, "decay_factors") and hasattr(mod, "slope_rate") and mod.slope_rate.dtype == torch.float64:
            # MiniMax lightning attention: its block-wise decay buffers, from the slopes, in fp64 (a model built in
            # fp32 and cast to fp64 keeps fp32-rounded decays, ~1e-8 off the recurrence with those slopes)
            mod.query_decay, mod.key_decay, mod.diagonal_decay = mod.decay_factors(mod.slope_rate)
        if hasattr(mod, "chunk_gated_delta_rule") and hasattr(mod, "A_log"):
            mod.chunk_gated_delta_rule = chunk_gated_delta_rule_ref
            mod.recurrent_gated_delta_rule = recurrent_gated_delta_rule_ref
            mod.forward = types.MethodType(_exact_gated_deltanet_forward, mod)


def _exact_gate_first_rmsnorm_forward(self, hidden_states: torch.Tensor, gate: Optional[torch.Tensor] = None):
    """The Mamba-2 gated norm: ``weight * g / rms(g)``, ``g = x * silu(gate)``, the rms over each ``group_size``
    block where the module has one (Nemotron-H / Zamba2; Falcon-H1: ``n_groups`` blocks), else over the last dim;
    Falcon-H1 with ``norm_before_gate``: ``weight * x / rms(x) * silu(gate)``. hidden_states, gate: ``[.., I]``."""
    dt = _compute_dtype(hidden_states)
    x = hidden_states.to(dt)
    after = getattr(self, "norm_before_gate", False)  # Falcon-H1's option: the gate after the norm
    if gate is not None and not after:
        x = x * torch.nn.functional.silu(gate.to(dt))
    gs = getattr(self, "group_size", None) or x.shape[-1] // getattr(self, "n_groups", 1)
    xg = x.reshape(*x.shape[:-1], -1, gs)
    x = (xg * torch.rsqrt(xg.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)).reshape(x.shape)
    if after:  # Falcon-H1: weight * norm(y), then the gate
        x = self.weight * x
        return (x * torch.nn.functional.silu(gate.to(dt)) if gate is not None else x).to(hidden_states.dtype)
    return self.weight * x.to(hidden_states.dtype)


def _exact_mamba2_mixer_forward(self, hidden_states: torch.Tensor, cache_params=None, attention_mask=None,
                                **kwargs) -> torch.Tensor:
    """The ordinary (one sequence per batch row) Mamba-2 mixer forward for the fp64 oracle: the model's own math
    (projection, causal conv per row, the scan over each whole row, ``D`` skip, gated norm, out_proj) with the scan in
    fp64 for fp64 inputs (the models' torch path casts ``x``, ``B``, ``C`` and ``A`` to fp32). Training forwards only.

    Args:
        hidden_states: ``[Bsz, L, hidden]``, one unpadded sequence per row.

    Returns:
        ``[Bsz, L, hidden]`` in the input dtype.
    """
    # zorro's (public) transcriptions of the token-wise parts, so the oracle and zorro cannot drift apart there; the
    # sequence mixing (conv per row, the scan over each whole row) is what the oracle checks and stays written out.
    from zorro_verl.integrations.transformers.ssm import (
        mamba2_gated_output,
        mamba2_projections,
        ssm_decay_rate,
        ssm_step_size,
        stock_runs_fused,
    )
    from zorro_verl.recurrent import chunk_ssd

    if cache_params is not None or attention_mask is not None:
        raise ValueError("exact Mamba-2 oracle: got a cache or an attention_mask; expected neither (run each row "
                         "unpadded with use_cache=False).")
    b, L, _ = hidden_states.shape
    gate, xBC, dt = mamba2_projections(self, hidden_states)
    xBC = self.act(self.conv1d(xBC.transpose(1, 2))[..., :L].transpose(1, 2))  # causal per row: the first L
    H, P, G, N = self.num_heads, self.head_dim, self.n_groups, self.ssm_state_size
    x, B, C = torch.split(xBC, [self.intermediate_size, G * N, G * N], dim=-1)
    cdt = _compute_dtype(x)
    x = x.reshape(b, L, H, P).to(cdt)
    y, _ = chunk_ssd(x, ssm_step_size(self, dt, stock_runs_fused(self, hidden_states)), ssm_decay_rate(self, cdt),
                     B.reshape(b, L, G, N),
                     C.reshape(b, L, G, N), chunk_size=self.chunk_size)
    y = y + self.D[:, None] * x
    return self.out_proj(mamba2_gated_output(self, y.reshape(b, L, -1), gate).to(hidden_states.dtype))


def _exact_mamba1_mixer_forward(self, hidden_states: torch.Tensor, cache_params=None, attention_mask=None,
                                **kwargs) -> torch.Tensor:
    """The ordinary (one sequence per batch row) Mamba (v1) mixer forward for the fp64 oracle: the model's math
    (projection, causal conv per row, selection, the step-by-step scan over each whole row, ``D`` skip, gate,
    out_proj) with the scan in fp64 for fp64 inputs (the models' torch path casts ``A`` and ``B`` to fp32).

    Args: hidden_states ``[Bsz, L, hidden]``, one unpadded sequence per row. Returns ``[Bsz, L, hidden]``.
    """
    from zorro_verl.integrations.transformers.ssm import mamba1_selection
    from zorro_verl.recurrent import selective_scan

    if cache_params is not None or attention_mask is not None:
        raise ValueError("exact Mamba oracle: got a cache or an attention_mask; expected neither (run each row "
                         "unpadded with use_cache=False).")
    L = hidden_states.shape[1]
    x, gate = self.in_proj(hidden_states).chunk(2, dim=-1)  # [b, L, D]
    x = self.act(self.conv1d(x.transpose(1, 2))[..., :L].transpose(1, 2))  # causal per row: the first L
    dt, B, C = mamba1_selection(self, x)
    y, _ = selective_scan(x, dt, -self.A_log.to(_compute_dtype(x)).exp(), B, C)
    y = (y.to(x.dtype) + x * self.D) * self.act(gate)
    return self.out_proj(y)


def _exact_logits_root_forward(self, input_ids=None, logits_to_keep=0, labels=None, **kwargs):
    """A ``*ForCausalLM`` forward without the fp32 cast of the logits (Mamba2 and Nemotron-H end in ``.float()``,
    which rounds fp64 logits to fp32): decoder, then the head on the kept rows. Returns ``CausalLMOutput``."""
    from transformers.modeling_outputs import CausalLMOutput

    if labels is not None:
        raise ValueError("exact fp64 root forward: labels are not supported (the oracles compute log-probs).")
    kwargs.pop("use_cache", None)
    h = self.get_decoder()(input_ids=input_ids, use_cache=False, **kwargs)[0]
    keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    return CausalLMOutput(logits=self.get_output_embeddings()(h[:, keep]))


def _exact_topk_gating_forward(self, hidden_states: torch.Tensor):
    """Granite MoE's top-k gating (``GraniteMoeHybridTopKGating``) with its router logits kept in fp64 for fp64 inputs
    (transformers: ``.float()``). hidden_states ``[N, H]``; returns the module's tuple ``(index_sorted_experts,
    batch_index, batch_gates, expert_size, logits)``."""
    logits = self.layer(hidden_states).to(_compute_dtype(hidden_states))  # [N, E]
    top_k_logits, top_k_indices = logits.topk(self.top_k, dim=1)
    top_k_gates = torch.softmax(top_k_logits, dim=1).type_as(hidden_states)
    gates = torch.zeros([top_k_gates.size(0), self.num_experts], dtype=top_k_gates.dtype,
                        device=top_k_gates.device).scatter(1, top_k_indices, 1)
    expert_size = gates.long().sum(0).tolist()
    _, index_sorted_experts = top_k_indices.flatten().sort(0)
    batch_index = index_sorted_experts.div(self.top_k, rounding_mode="trunc")
    batch_gates = top_k_gates.flatten()[index_sorted_experts]
    return index_sorted_experts, batch_index, batch_gates, expert_size, logits


def exact_fp64_ssm(model) -> None:
    """Per-instance fp64-exact swaps for state-space models (test oracle only; fp32/bf16 behaviour unchanged): the
    RMSNorms (:func:`exact_fp64_norms`), Granite's MoE top-k gating, the gated norms of the mixers' output, the
    mixers' forward (:func:`_exact_mamba2_mixer_forward`, :func:`_exact_mamba1_mixer_forward`: the scan in fp64) and,
    for roots that cast their logits to fp32 (Mamba2, Nemotron-H, Mamba, FalconMamba), the root forward."""
    exact_fp64_norms(model)
    for mod in model.modules():
        name = type(mod).__name__
        if name.endswith("RMSNormGated") and hasattr(mod, "variance_epsilon"):
            mod.forward = types.MethodType(_exact_gate_first_rmsnorm_forward, mod)
        elif all(hasattr(mod, a) for a in ("in_proj", "conv1d", "A_log", "D", "n_groups", "ssm_state_size")):
            mod.forward = types.MethodType(_exact_mamba2_mixer_forward, mod)
        elif all(hasattr(mod, a) for a in ("in_proj", "conv1d", "A_log", "D", "x_proj", "dt_proj")):
            mod.forward = types.MethodType(_exact_mamba1_mixer_forward, mod)
        elif name.endswith("TopKGating") and all(hasattr(mod, a) for a in ("layer", "top_k", "num_experts")):
            mod.forward = types.MethodType(_exact_topk_gating_forward, mod)
    if type(model).__name__ in ("Mamba2ForCausalLM", "NemotronHForCausalLM", "MambaForCausalLM",
                                "FalconMambaForCausalLM"):
        model.forward = types.MethodType(_exact_logits_root_forward, model)


#: Name of :func:`fp64_eager_attention` in transformers' attention and mask interfaces (test oracles only).
FP64_EAGER = "fp64_eager"


def fp64_eager_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                         softcap=None, s_aux=None, **kwargs):
    """transformers' eager attention of the Gemma 2/3 and gpt-oss families with the softmax in the input dtype.

    Their own eager functions upcast the softmax to fp32 (Gemma; ~1e-8 in fp64) — gpt-oss keeps the dtype and is
    what this one reproduces: ``scores = q k^T * scaling``, soft-capped (``softcap * tanh(scores / softcap)``), plus
    transformers' additive mask (causal and the layer's sliding window, built by its own ``eager_mask``), the sink
    logits ``s_aux [Hq]`` as one extra softmax column dropped after the softmax, times ``v``. The sliding window
    reaches this function only through the mask, as in the ordinary eager path.

    Args:
        query: ``[b, Hq, L, D]``; key/value: ``[b, Hkv, L, D]``; attention_mask: ``[b, 1, L, L]`` additive or None.

    Returns:
        ``([b, L, Hq, D], None)``.
    """
    if dropout:
        raise ValueError(f"fp64 eager oracle: dropout {dropout}; expected 0 (oracle forwards are deterministic).")
    hq, hkv = query.shape[1], key.shape[1]
    k = key.repeat_interleave(hq // hkv, 1)
    v = value.repeat_interleave(hq // hkv, 1)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    s = torch.matmul(query, k.transpose(2, 3)) * scaling
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if attention_mask is not None:
        s = s + attention_mask
    if s_aux is not None:
        sink = s_aux.to(s.dtype).reshape(1, -1, 1, 1).expand(*s.shape[:-1], 1)
        p = torch.softmax(torch.cat([s, sink], -1), -1)[..., :-1]
    else:
        p = torch.softmax(s, -1)
    return torch.matmul(p.to(value.dtype), v).transpose(1, 2).contiguous(), None


def register_fp64_eager_attention() -> None:
    """Register :func:`fp64_eager_attention` (with transformers' eager mask) as ``"fp64_eager"`` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(FP64_EAGER, fp64_eager_attention)
    AttentionMaskInterface.register(FP64_EAGER, eager_mask)


class KeepFp64(torch.overrides.TorchFunctionMode):
    """A torch-function mode in which every request for fp32 gets fp64 (test oracles only; the model in fp64).

    transformers' model code upcasts to fp32 where its dtype is lower (norms, routers, softmaxes, rotary tables,
    recurrences): in an fp64 model each such cast rounds to fp32, and the ordinary and the deduplicated forward,
    whose sums run in different orders (~1e-16 apart), come out ~1e-8 apart after it — rounding, not zorro. Under
    this mode the same code runs those steps in fp64: ``Tensor.float()``, ``Tensor.to(torch.float32)`` (positional,
    ``dtype=`` or an fp32 tensor argument), ``Tensor.type(torch.float32)``, ``Tensor.type_as(fp32 tensor)`` and any
    call with ``dtype=torch.float32`` (factories, softmax) give fp64; the default dtype is fp64 inside. Every other
    call is unchanged. The generic counterpart of the per-module swaps above (:func:`exact_fp64_norms`), for the
    every-family test, whose models are built and run entirely in fp64 (:func:`to_fp64`).
    """

    def __enter__(self):
        self._default = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        return super().__enter__()

    def __exit__(self, *exc):
        torch.set_default_dtype(self._default)
        return super().__exit__(*exc)

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        fp32, fp64 = torch.float32, torch.float64
        if kwargs.get("dtype") is fp32:
            kwargs = {**kwargs, "dtype": fp64}
        if func is torch.Tensor.float:
            return args[0].to(fp64)
        if func is torch.Tensor.to:
            args = tuple(fp64 if a is fp32 else
                         (a.to(fp64) if isinstance(a, torch.Tensor) and a.dtype == fp32 else a) for a in args)
        elif func is torch.Tensor.type and args[1:2] == (fp32,):
            return args[0].to(fp64)
        elif func is torch.Tensor.type_as and args[1].dtype == fp32:
            return args[0].to(fp64)
        return func(*args, **kwargs)


def to_fp64(model):
    """Every floating parameter and buffer of ``model`` in fp64 (modules transformers keeps in fp32, rotary
    frequency tables), so that under :class:`KeepFp64` no fp32 tensor is left to meet an fp64 one. Returns
    ``model``."""
    return model.to(torch.float64)
