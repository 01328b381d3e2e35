"""Recurrent (linear-attention) layers on the packed dedup row: causal conv and gated delta rule by segment.

Hybrid models (Qwen3.5, Qwen3-Next, OLMo-hybrid) interleave full attention with gated delta-net layers. Such a layer
mixes the sequence twice, both causally: a short depthwise causal conv (kernel ``Kc``, typically 4) and the gated
delta rule, a recurrence over a state ``S [H, Dk, Dv]``. On the packed row ``[P | R1 | R2 | ...]`` run unchanged,
``R2`` would start from the state left by ``R1``. Here each group's prompt is processed once and every response
starts from its prompt's final recurrent state and conv context (the last ``Kc-1`` prompt inputs, zeros where the
prompt is shorter); autograd sums every response's use of those states back into the shared prompt::

    ordinary row b:   [ P_g .......... | R_b ]         one uninterrupted pass
    packed:           [ P_g ] -> S_g ;  [ R_b ] from S_g (all responses of all groups in one kernel call)

Shapes (legend in :mod:`zorro_verl.packing.plan`): ``C`` conv channels, ``H`` value heads, ``Dk``/``Dv`` key/value
head dims. Kernel contract (transformers' torch fallbacks and flash-linear-attention alike):
``fn(q [b, L, H, Dk], k [b, L, H, Dk], v [b, L, H, Dv], g [b, L, H], beta [b, L, H], initial_state=[b, H, Dk, Dv]
| None, output_final_state=bool, use_qk_l2norm_in_kernel=bool) -> (o [b, L, H, Dv], final [b, H, Dk, Dv] | None)``.

Padding: a token with ``k = 0, beta = 0, g = 0`` leaves the state unchanged (decay ``exp(0) = 1``, rank-one update
``k * delta = 0``), so right-padding prompts and responses with zeros is exact; a padded prompt's final state is
its state after its last valid token.

Prefix trees (``plan.tree``): the state is carried down the trie, one kernel call per node depth, each node
starting from its parent's final state; each node's conv context is the last ``Kc-1`` inputs of its root path.

This module imports torch and :mod:`zorro_verl.packing` only.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from zorro_verl.packing import ZorroPlan
from zorro_verl.packing.segments import cu_seqlens, segments_to_tokens
from zorro_verl.packing.tree import path_index

__all__ = [
    "conv_expanded_index",
    "packed_causal_conv",
    "recurrent_segment_index",
    "packed_gated_delta_rule",
    "chunk_gated_delta_rule_ref",
    "recurrent_gated_delta_rule_ref",
]



# ---------------------------------------------------------------------------------------------------- causal conv
def conv_expanded_index(plan: ZorroPlan, kernel_size: int) -> dict:
    """Index set of the packed causal conv: every segment preceded by its ``Kc-1`` context slots.

    Expanded row (``X`` = a context slot)::

        packed:    [ P0 ....... | R00 ... | R01 ... | P1 ... | R10 ... ]
        expanded:  [ XXX P0 ... | XXX R00 | XXX R01 | XXX P1 | XXX R10 ]

    A prompt's slots are zeros (the ordinary conv's left padding); a response's slots hold the last ``Kc-1`` inputs
    of its group's prompt (zeros where the prompt is shorter). One causal conv over the expanded row then gives, at
    each token, exactly the conv of its ordinary row ``[prompt | response]``: a window of ``Kc`` never reaches past a
    segment's context slots.

    Returns ``{"src": [Lx] int64`` (packed index feeding each expanded slot, ``T`` = a zero row), ``"pos": [T] int64``
    (expanded position of each packed token)``}``, ``Lx = T + (Kc-1) * (G + non-empty responses)``.
    Memoised in the plan under ``("recurrent_conv", Kc)``.

    Prefix trees: every node gets ``Kc-1`` slots holding the last ``Kc-1`` inputs of its root path before it (they
    may span several ancestors; zeros where the path is shorter), read through the ancestor table.
    """

    def build():
        if plan.tree is not None:
            return _tree_conv_index(plan, kernel_size)
        dev = plan.device
        c = kernel_size - 1
        _, seg, _ = plan.token_layout()  # [T]
        is_start = torch.ones(plan.T, dtype=torch.bool, device=dev)
        is_start[1:] = seg[1:] != seg[:-1]
        ordinal = torch.cumsum(is_start.long(), 0)  # [T] 1 + packed-order index of the token's segment
        t = torch.arange(plan.T, device=dev)
        pos = t + c * ordinal  # [T]
        n_seg = plan.G + plan.num_nonempty_responses
        src = torch.full((plan.T + c * n_seg,), plan.T, dtype=torch.long, device=dev)
        src[pos] = t
        if c > 0 and plan.N > 0:
            rows = recurrent_segment_index(plan)["rows"]  # [Bnz] non-empty responses
            g = plan.row_group[rows]
            m = torch.arange(c, device=dev)
            v = plan.prompt_lens[g][:, None] - c + m[None, :]  # [Bnz, c] position in the ordinary row
            slot = pos[plan.response_start[rows]][:, None] - c + m[None, :]
            src[slot] = torch.where(v >= 0, plan.prompt_start[g][:, None] + v, plan.T)
        return {"src": src, "pos": pos}

    return plan.memo.get(("recurrent_conv", kernel_size), build)


def _tree_conv_index(plan: ZorroPlan, kernel_size: int) -> dict:
    """:func:`conv_expanded_index` of a tree plan: nodes are the segments (contiguous, packed order)."""
    tree, dev, c = plan.tree, plan.device, kernel_size - 1
    t = torch.arange(plan.T, device=dev)
    pos = t + c * (tree.token_node + 1)  # [T]: c slots before every node
    src = torch.full((plan.T + c * tree.M,), plan.T, dtype=torch.long, device=dev)
    src[pos] = t
    if c > 0:
        m = torch.arange(c, device=dev)
        depth = tree.node_pos0[:, None] - c + m[None, :]  # [M, c] string depth of each context slot
        ctx = path_index(tree, torch.arange(tree.M, device=dev), depth.clamp(min=0))
        slot = pos[tree.node_start][:, None] - c + m[None, :]
        src[slot] = torch.where(depth >= 0, ctx, plan.T)
    return {"src": src, "pos": pos}


def packed_causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], plan: ZorroPlan, *,
                       activation: Optional[str] = None, causal_conv1d_fn: Optional[Callable] = None) -> torch.Tensor:
    """Depthwise causal conv of every ordinary row, computed once per packed token.

    Args:
        x: ``[T, C]`` conv inputs of the packed row.
        weight: ``[C, Kc]`` (``conv1d.weight.squeeze(1)``); bias: ``[C]`` or ``None``.
        activation: ``None`` or ``"silu"`` (applied after the conv).
        causal_conv1d_fn: the causal-conv1d package's kernel (GPU), called as the model calls it; else
            ``torch.nn.functional.conv1d``.

    Returns:
        ``[T, C]`` equal to ``act(conv1d(row, padding=Kc-1)[:len])`` of each ordinary row at its tokens. The gather
        into the expanded row adds, in backward, each response's use of its prompt's last ``Kc-1`` inputs into the
        prompt. Memory: one ``[T + (Kc-1)(G+B), C]`` copy of the inputs.
    """
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation: expected None or 'silu', got {activation!r}.")
    T, C = x.shape
    Kc = weight.shape[-1]
    idx = conv_expanded_index(plan, Kc)
    x_exp = torch.cat([x, x.new_zeros(1, C)])[idx["src"]]  # [Lx, C]; row T of the source is the zero slot
    if causal_conv1d_fn is not None:
        y = causal_conv1d_fn(x=x_exp.t()[None], weight=weight, bias=bias, activation=activation)  # [1, C, Lx]
        return y[0].t()[idx["pos"]]
    y = torch.nn.functional.conv1d(x_exp.t()[None], weight[:, None, :], bias, groups=C)  # [1, C, Lx - Kc + 1]
    out = y[0].t()[idx["pos"] - (Kc - 1)]  # output j is the window ending at expanded position j + Kc - 1
    return torch.nn.functional.silu(out) if activation else out


# ---------------------------------------------------------------------------------------------------- gated delta rule
def recurrent_segment_index(plan: ZorroPlan) -> dict:
    """Index sets of the two recurrent calls (prompts, then responses from their prompt's state).

    * padded (any kernel): ``prompt_index [G, Pmax]``, ``prompt_valid [G, Pmax] bool``, ``response_index [B, Rmax]``,
      ``response_valid [B, Rmax] bool`` (0 / False on pads, right padded); ``padded_out [T]``: each packed token's
      place in ``cat(prompt_out [G*Pmax], response_out [B*Rmax])``.
    * varlen (flash-linear-attention): ``prompt_tokens [Np]``, ``cu_prompt [G+1] int64``; ``rows [Bnz]`` non-empty
      responses in packed order, ``response_tokens [N]``, ``cu_response [Bnz+1] int64``; ``varlen_out [T]``: each
      packed token's place in ``cat(prompt_out [Np], response_out [N])``.

    Memoised in the plan under ``"recurrent_segments"``. Prefix trees: :func:`tree_level_index` instead.
    """

    def build():
        dev = plan.device
        Pm, Rm = plan.max_prompt_len, plan.max_response_len
        ar_p = torch.arange(Pm, device=dev)
        ar_r = torch.arange(Rm, device=dev)
        p_valid = ar_p[None, :] < plan.prompt_lens[:, None]  # [G, Pmax]
        r_valid = ar_r[None, :] < plan.response_lens[:, None]  # [B, Rmax]
        p_idx = torch.where(p_valid, plan.prompt_start[:, None] + ar_p[None, :], 0)
        r_idx = torch.where(r_valid, plan.response_start[:, None] + ar_r[None, :], 0)
        # No boolean indexing (a hidden host sync): every size below is a Python int of the plan.
        prompt_tokens = segments_to_tokens(plan.prompt_start, plan.prompt_lens, plan.num_prompt_tokens)
        ar_b = torch.arange(plan.B, device=dev)
        tok_g = torch.repeat_interleave(torch.arange(plan.G, device=dev), plan.prompt_lens,
                                        output_size=plan.num_prompt_tokens)
        all_resp = segments_to_tokens(plan.response_start, plan.response_lens, plan.N)  # rows in 0..B-1 order
        tok_b = torch.repeat_interleave(ar_b, plan.response_lens, output_size=plan.N)
        padded_out = torch.empty(plan.T, dtype=torch.long, device=dev)
        padded_out[prompt_tokens] = tok_g * Pm + prompt_tokens - plan.prompt_start[tok_g]
        padded_out[all_resp] = plan.G * Pm + tok_b * Rm + all_resp - plan.response_start[tok_b]

        rows = plan.nonempty_rows()  # packed order, empty rows dropped
        r = plan.response_lens[rows]
        response_tokens = segments_to_tokens(plan.response_start[rows], r, plan.N)
        varlen_out = torch.empty(plan.T, dtype=torch.long, device=dev)
        varlen_out[prompt_tokens] = torch.arange(plan.num_prompt_tokens, device=dev)
        varlen_out[response_tokens] = plan.num_prompt_tokens + torch.arange(plan.N, device=dev)
        return {
            "prompt_index": p_idx, "prompt_valid": p_valid, "response_index": r_idx, "response_valid": r_valid,
            "padded_out": padded_out,
            "prompt_tokens": prompt_tokens, "cu_prompt": cu_seqlens(plan.prompt_lens).long(), "rows": rows,
            "response_tokens": response_tokens, "cu_response": cu_seqlens(r).long(), "varlen_out": varlen_out,
        }

    return plan.memo.get("recurrent_segments", build)


def tree_level_index(plan: ZorroPlan) -> list:
    """Per node depth ``d`` of a tree plan (memoised under ``"recurrent_tree"``): ``(index [n_d, L_d], valid [n_d,
    L_d] bool, parent_rank [n_d] | None)`` — the level's nodes right padded (packed order), and each node's
    parent's row in the previous level (whose final states are its initial states)."""

    def build():
        tree, dev = plan.tree, plan.device
        rank = torch.zeros(tree.M, dtype=torch.long, device=dev)
        out = []
        for d, (n, L) in enumerate(tree.level_sizes):
            nodes = torch.argsort((tree.node_depth != d).to(torch.int8), stable=True)[:n]  # no host sync
            rank[nodes] = torch.arange(n, device=dev)
            ar = torch.arange(L, device=dev)
            valid = ar[None, :] < tree.node_len[nodes][:, None]
            index = torch.where(valid, tree.node_start[nodes][:, None] + ar[None, :], 0)
            out.append((index, valid, rank[tree.node_parent[nodes]].clone() if d > 0 else None))
        return out

    return plan.memo.get("recurrent_tree", build)


def _tree_delta_rule(kernel, q, k, v, g, beta, plan, kw) -> torch.Tensor:
    """Tree plans: one padded kernel call per node depth, each node starting from its parent's final state."""
    levels = tree_level_index(plan)
    outs, state = [], None
    for d, (index, valid, parent) in enumerate(levels):
        o, state = kernel(*(_gather_padded(x, index, valid) for x in (q, k, v, g, beta)),
                          initial_state=None if parent is None else state[parent],
                          output_final_state=d + 1 < len(levels), **kw)  # o [n_d, L_d, H, Dv]
        outs.append(o.reshape(-1, *o.shape[2:]))
    # each packed token's place in cat(level outputs): built once per plan
    return torch.cat(outs)[_tree_out_index(plan, levels)]


def _tree_out_index(plan: ZorroPlan, levels: list) -> torch.Tensor:
    """``[T]``: each packed token's slot in ``cat`` of the per-level padded outputs (memoised)."""

    def build():
        out = torch.empty(plan.T + 1, dtype=torch.long, device=plan.device)
        offset = 0
        for index, valid, _ in levels:
            slots = offset + torch.arange(index.numel(), device=plan.device)
            out.scatter_(0, torch.where(valid, index, plan.T).flatten(), slots)  # pads -> dummy slot T, dropped
            offset += index.numel()
        return out[:plan.T]

    return plan.memo.get("recurrent_tree_out", build)


def _gather_padded(x: torch.Tensor, index: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``x [T, ...]`` -> ``[n, L, ...]`` at ``index [n, L]``; zeros where not ``valid`` (state-preserving pads)."""
    out = x[index]
    return out * valid.view(*valid.shape, *([1] * (x.dim() - 1))).to(out.dtype)


def packed_gated_delta_rule(kernel: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor, plan: ZorroPlan, *, varlen: bool = False,
                            use_qk_l2norm_in_kernel: bool = True) -> torch.Tensor:
    """The gated delta rule of every ordinary row, each prompt run once.

    Args:
        kernel: a chunked gated-delta-rule function with the module docstring's contract.
        q, k: ``[T, H, Dk]``; v: ``[T, H, Dv]``; g (log decay), beta: ``[T, H]`` — the packed row.
        varlen: the kernel takes ``cu_seqlens`` with one ``initial_state`` per sequence (flash-linear-attention):
            call it on the packed tokens without padding. Otherwise prompts ``[G, Pmax]`` and responses
            ``[B, Rmax]`` are right padded with zeros.

    Returns:
        ``o [T, H, Dv]`` in the kernel's output dtype. Two kernel calls; responses of all groups run together,
        each starting from ``final_state[row_group]`` of its prompt (gradients flow into the prompt through it).
        Prefix trees: one call per node depth, every node from its parent's final state (padded, any kernel).
    """
    kw = dict(use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    if plan.tree is not None:  # padded per level for every kernel (exact: zero pads keep the state)
        return _tree_delta_rule(kernel, q, k, v, g, beta, plan, kw)
    idx = recurrent_segment_index(plan)
    if varlen:
        pt = idx["prompt_tokens"]
        o_p, s_p = kernel(q[pt][None], k[pt][None], v[pt][None], g[pt][None], beta[pt][None], initial_state=None,
                          output_final_state=True, cu_seqlens=idx["cu_prompt"], **kw)  # o_p [1, Np, H, Dv]
        outs = [o_p[0]]
        if plan.N > 0:
            rt = idx["response_tokens"]
            h0 = s_p[plan.row_group[idx["rows"]]]  # [Bnz, H, Dk, Dv]
            o_r, _ = kernel(q[rt][None], k[rt][None], v[rt][None], g[rt][None], beta[rt][None], initial_state=h0,
                            output_final_state=False, cu_seqlens=idx["cu_response"], **kw)
            outs.append(o_r[0])
        return torch.cat(outs)[idx["varlen_out"]]

    pi, pv = idx["prompt_index"], idx["prompt_valid"]
    o_p, s_p = kernel(*(_gather_padded(x, pi, pv) for x in (q, k, v, g, beta)), initial_state=None,
                      output_final_state=True, **kw)  # o_p [G, Pmax, H, Dv], s_p [G, H, Dk, Dv]
    outs = [o_p.reshape(-1, *o_p.shape[2:])]
    if plan.max_response_len > 0:
        ri, rv = idx["response_index"], idx["response_valid"]
        o_r, _ = kernel(*(_gather_padded(x, ri, rv) for x in (q, k, v, g, beta)),
                        initial_state=s_p[plan.row_group], output_final_state=False, **kw)  # [B, Rmax, H, Dv]
        outs.append(o_r.reshape(-1, *o_r.shape[2:]))
    return torch.cat(outs)[idx["padded_out"]]


# ---------------------------------------------------------------------------------------------------- references
def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta, use_qk_l2norm_in_kernel):
    """Cast to the compute dtype (fp64 stays fp64, else fp32) and move heads first: ``[b, H, L, ...]``."""
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q.to(dt)), _l2norm(k.to(dt))
    q, k, v, g, beta = (x.to(dt).transpose(1, 2) for x in (q, k, v, g, beta))
    return dt, q * q.shape[-1] ** -0.5, k, v, g, beta


def recurrent_gated_delta_rule_ref(q, k, v, g, beta, initial_state=None, output_final_state=False,
                                   use_qk_l2norm_in_kernel=False, **unused):
    """Step-by-step gated delta rule (the definition; slow, for tests). Keeps fp64 in fp64, else computes in fp32.

    Per head, with ``S [Dk, Dv]``: ``S = exp(g_t) S;  u_t = beta_t (v_t - S^T k_t);  S = S + k_t u_t^T;
    o_t = S^T q_t / sqrt(Dk)``. Shapes as in the module docstring; returns ``(o [b, L, H, Dv] in q's dtype,
    final [b, H, Dk, Dv] | None)``.
    """
    in_dtype = q.dtype
    dt, q, k, v, g, beta = _prepare(q, k, v, g, beta, use_qk_l2norm_in_kernel)
    b, H, L, Dk = k.shape
    S = q.new_zeros(b, H, Dk, v.shape[-1]) if initial_state is None else initial_state.to(dt)
    outs = []
    for t in range(L):
        S = S * g[:, :, t, None, None].exp()
        u = beta[:, :, t, None] * (v[:, :, t] - (S * k[:, :, t, :, None]).sum(-2))  # [b, H, Dv]
        S = S + k[:, :, t, :, None] * u[:, :, None, :]
        outs.append((S * q[:, :, t, :, None]).sum(-2))
    o = torch.stack(outs, 2) if outs else v.new_zeros(b, H, 0, v.shape[-1])
    return o.transpose(1, 2).to(in_dtype), (S if output_final_state else None)


def chunk_gated_delta_rule_ref(q, k, v, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, **unused):
    """Chunked gated delta rule (WY form, triangular solve per chunk). Keeps fp64 in fp64, else fp32.

    Drop-in for transformers' ``torch_chunk_gated_delta_rule`` (same contract) with a dtype-preserving compute
    type, so fp64 tests of hybrid models reach ~1e-15. Within a chunk with inclusive log-decay prefix ``c``:
    ``(I + A) u = beta v - beta e^{c} K S0`` with ``A_ij = beta_i e^{c_i - c_j} k_i.k_j`` (j < i);
    ``o = e^{c} Q S0 + (Q K^T * e^{c_i - c_j}, j <= i) u``; ``S1 = e^{c_last} S0 + (K e^{c_last - c})^T u``.
    """
    in_dtype = q.dtype
    dt, q, k, v, g, beta = _prepare(q, k, v, g, beta, use_qk_l2norm_in_kernel)
    b, H, L, Dk = k.shape
    Dv = v.shape[-1]
    n = -(-L // chunk_size)
    pad = n * chunk_size - L
    if pad:  # zero tokens keep the state (see module docstring); outputs there are dropped
        q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (torch.nn.functional.pad(x, (0, pad)) for x in (g, beta))
    q, k, v = (x.reshape(b, H, n, chunk_size, x.shape[-1]) for x in (q, k, v))  # [b, H, n, c, D]
    g, beta = (x.reshape(b, H, n, chunk_size) for x in (g, beta))
    c = g.cumsum(-1)  # [b, H, n, c]
    ar = torch.arange(chunk_size, device=q.device)
    incl = ar[:, None] >= ar[None, :]
    diff = c[..., :, None] - c[..., None, :]  # [b, H, n, c, c]
    decay_incl = diff.masked_fill(~incl, float("-inf")).exp()  # e^{c_i - c_j}, j <= i, else 0
    strict = ar[:, None] > ar[None, :]
    A = (beta[..., None] * (k @ k.transpose(-1, -2)) * decay_incl).masked_fill(~strict, 0)  # strictly lower
    eye = torch.eye(chunk_size, dtype=dt, device=q.device)
    rhs = torch.cat([beta[..., None] * v, beta[..., None] * c.exp()[..., None] * k], -1)  # [.., c, Dv + Dk]
    w = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
    w_v, w_k = w[..., :Dv], w[..., Dv:]  # u = w_v - w_k @ S0
    qk = (q @ k.transpose(-1, -2)) * decay_incl  # [b, H, n, c, c]
    q_dec = q * c.exp()[..., None]
    k_dec = k * (c[..., -1:] - c).exp()[..., None]
    S = q.new_zeros(b, H, Dk, Dv) if initial_state is None else initial_state.to(dt)
    outs = []
    for i in range(n):  # inherently sequential over chunks
        u = w_v[:, :, i] - w_k[:, :, i] @ S  # [b, H, c, Dv]
        outs.append(q_dec[:, :, i] @ S + qk[:, :, i] @ u)
        S = S * c[:, :, i, -1, None, None].exp() + k_dec[:, :, i].transpose(-1, -2) @ u
    o = torch.stack(outs, 2).reshape(b, H, n * chunk_size, Dv)[:, :, :L]
    return o.transpose(1, 2).to(in_dtype), (S if output_final_state else None)
