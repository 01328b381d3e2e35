"""The Mamba-2 SSM (state-space duality, "SSD") and the Mamba (v1) selective scan on the packed dedup row: prompts
once, responses from their prompt's final state.

A Mamba-2 layer (Mamba2, Bamba, Granite 4 hybrid, Nemotron-H, ...) mixes the sequence twice, both causally: a
depthwise causal conv over ``[x | B | C]`` (the same conv as the gated delta-net's: :func:`.packed.packed_causal_conv`)
and the selective scan, a recurrence per head over a state ``S [P, N]`` (``P`` head dim, ``N`` state size) with a
scalar per-token decay::

    S_t = exp(dt_t * A) S_{t-1} + dt_t * x_t B_t^T          y_t = S_t C_t          (+ D * x_t, token-wise)

``A < 0`` per head; ``dt [L, H]`` the step size after the model's softplus and clamp; ``B, C [L, G, N]`` shared by
the ``H / G`` heads of each group. As for the delta rule (:mod:`.packed`), each group's prompt runs once and every
response starts from its prompt's final state; autograd sums every response's use of that state back into the prompt.

Kernel contract (:func:`chunk_ssd`, the torch chunked scan zorro runs; :func:`recurrent_ssd_ref`, the slow
definition; :func:`fused_ssd_kernel`, mamba-ssm's fused ``mamba_chunk_scan_combined`` behind it): ``fn(x [b, L, H, P],
dt [b, L, H], A [H], B [b, L, G, N], C [b, L, G, N], initial_state=[b, H, P, N] | None, output_final_state=bool) ->
(y [b, L, H, P], final [b, H, P, N] | None)``, ``y`` without the ``D`` term.

Padding: a token with ``dt = 0`` leaves the state unchanged (decay ``exp(0) = 1``, update ``0``), so right-padding with
zeros is exact and a padded prompt's final state is its state after its last valid token.

Mamba v1 (Mamba, FalconMamba) has a per-element decay ``exp(dt_t[d] A[d, n])`` over a state ``[D, N]`` per channel:
:func:`selective_scan` runs it step by step (as transformers' torch path does), :func:`packed_selective_scan` by
segment.

Prefix trees (``plan.tree``): the state is carried down the trie, one kernel call per node depth, each node starting
from its parent's final state (the index sets of :mod:`.packed`).

This module imports torch and :mod:`zorro_verl.packing` only.
"""

from __future__ import annotations

from typing import Callable

import torch

from zorro_verl.packing import ZorroPlan
from zorro_verl.recurrent.packed import _gather_padded, _tree_out_index, recurrent_segment_index, tree_level_index

__all__ = ["packed_ssd", "chunk_ssd", "fused_ssd_kernel", "recurrent_ssd_ref", "selective_scan",
           "packed_selective_scan"]


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp64 stays fp64; everything else runs in fp32, as transformers' torch path (``.float()``) does."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _heads(t: torch.Tensor, H: int) -> torch.Tensor:
    """``[b, L, G, N] -> [b, L, H, N]``: each group's ``B`` / ``C`` for its ``H / G`` heads (group-major, as the
    models' ``repeat_interleave``)."""
    return t.repeat_interleave(H // t.shape[2], dim=2, output_size=H)


def recurrent_ssd_ref(x, dt, A, B, C, initial_state=None, output_final_state=False):
    """Step-by-step Mamba-2 recurrence (the definition; slow, for tests). fp64 stays fp64, else fp32.

    Per head: ``S = exp(dt_t A) S + dt_t x_t B_t^T;  y_t = S C_t``. Shapes as in the module docstring; returns
    ``(y [b, L, H, P] in the compute dtype, final [b, H, P, N] | None)``.
    """
    dt_ = _compute_dtype(x)
    b, L, H, P = x.shape
    x, dt, A = x.to(dt_), dt.to(dt_), A.to(dt_)
    B, C = _heads(B.to(dt_), H), _heads(C.to(dt_), H)
    S = x.new_zeros(b, H, P, B.shape[-1]) if initial_state is None else initial_state.to(dt_)
    ys = []
    for t in range(L):
        S = S * (dt[:, t] * A).exp()[..., None, None] + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        ys.append((S * C[:, t, :, None, :]).sum(-1))  # [b, H, P]
    y = torch.stack(ys, 1) if ys else x.new_zeros(b, 0, H, P)
    return y, (S if output_final_state else None)


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """``[..., c] -> [..., c, c]``: ``out[i, j] = a[j+1] + ... + a[i]`` for ``j <= i`` (0 on the diagonal), ``-inf``
    above it. Summed from the terms themselves (a masked cumsum, as the models' ``segment_sum``): the difference of
    two long prefix sums would cancel, costing fp32 precision in the values and, more, in the gradient of ``A``."""
    c = a.shape[-1]
    ar = torch.arange(c, device=a.device)
    x = a[..., :, None].expand(*a.shape, c).masked_fill(~(ar[:, None] > ar[None, :]), 0)  # x[i, j] = a_i, i > j
    return x.cumsum(-2).masked_fill(~(ar[:, None] >= ar[None, :]), float("-inf"))


def chunk_ssd(x, dt, A, B, C, initial_state=None, output_final_state=False, chunk_size: int = 64):
    """Chunked Mamba-2 scan (the SSD block decomposition), the kernel zorro runs in torch. fp64 stays fp64, else fp32.

    Within a chunk with inclusive log-decay prefix ``c = cumsum(dt * A)``:
    ``y_i = sum_{j<=i} e^{c_i - c_j} (C_i . B_j) dt_j x_j + e^{c_i} S0 C_i``;
    ``S1 = e^{c_last} S0 + sum_j e^{c_last - c_j} dt_j x_j B_j^T``; chunks run in sequence. Shapes as in the module
    docstring; returns ``(y [b, L, H, P] in the compute dtype, final [b, H, P, N] | None)``. Memory: ``[b, H, n, c, c]``
    decay and score blocks (``c = chunk_size``).
    """
    dt_ = _compute_dtype(x)
    b, L, H, P = x.shape
    N = B.shape[-1]
    n = -(-L // chunk_size)
    pad = n * chunk_size - L
    x, dt, A = x.to(dt_), dt.to(dt_), A.to(dt_)
    B, C = _heads(B.to(dt_), H), _heads(C.to(dt_), H)
    if pad:  # dt = 0 tokens keep the state (module docstring); their outputs are dropped
        x, B, C = (torch.nn.functional.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x, B, C))
        dt = torch.nn.functional.pad(dt, (0, 0, 0, pad))
    # heads first, chunked: [b, H, n, c, ...]
    x, B, C = (t.transpose(1, 2).reshape(b, H, n, chunk_size, t.shape[-1]) for t in (x, B, C))
    dt = dt.transpose(1, 2).reshape(b, H, n, chunk_size)
    a = dt * A[None, :, None, None]  # [b, H, n, c] log decay per token
    seg = _segsum(a)  # [b, H, n, c, c]: c_i - c_j as a sum of its own terms (no cancellation), -inf for j > i
    decay = seg.exp()  # e^{c_i - c_j}, j <= i
    xdt = x * dt[..., None]  # [b, H, n, c, P]
    scores = (C @ B.transpose(-1, -2)) * decay  # [b, H, n, c, c]
    y_diag = scores @ xdt  # [b, H, n, c, P]
    C_dec = C * a.cumsum(-1).exp()[..., None]  # [b, H, n, c, N]: e^{c_i}
    x_dec = xdt * decay[..., -1, :, None]  # [b, H, n, c, P]: e^{c_last - c_j}
    c_last = seg[..., -1, 0] + a[..., 0]  # [b, H, n]: the chunk's total log decay
    S = x.new_zeros(b, H, P, N) if initial_state is None else initial_state.to(dt_)
    ys = []
    for i in range(n):  # inherently sequential over chunks
        ys.append(y_diag[:, :, i] + C_dec[:, :, i] @ S.transpose(-1, -2))  # [b, H, c, P]
        S = S * c_last[:, :, i, None, None].exp() + x_dec[:, :, i].transpose(-1, -2) @ B[:, :, i]
    y = torch.stack(ys, 2).reshape(b, H, n * chunk_size, P)[:, :, :L]
    return y.transpose(1, 2), (S if output_final_state else None)


def fused_ssd_kernel(scan_fn: Callable, chunk_size: int) -> Callable:
    """The kernel contract (module docstring) over mamba-ssm's fused Mamba-2 scan.

    ``scan_fn`` is ``mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined`` (as the model's module loaded it):
    ``scan_fn(x, dt, A, B, C, chunk_size, initial_states=[b, H, P, N] | None, return_final_states=bool) -> y`` or
    ``(y, final)``, differentiable in every input including ``initial_states`` (its backward returns their gradient, so
    each response's use of its prompt's final state flows back into the prompt). It is called with ``dt`` already
    through the model's softplus and clamp (no ``dt_bias``, no ``dt_softplus``, no ``dt_limit``), so that a padding
    token's ``dt = 0`` keeps the state exactly, and without ``D``, ``z``, ``seq_idx`` (each segment is its own batch
    row). ``y`` comes back in ``x``'s dtype (the kernel accumulates in fp32), ``final`` as the kernel returns it.
    """
    def kernel(x, dt, A, B, C, initial_state=None, output_final_state=False):
        out = scan_fn(x, dt, A, B, C, chunk_size, initial_states=initial_state,
                      return_final_states=output_final_state)
        return (out[0], out[1]) if output_final_state else (out, None)

    return kernel


def _packed_scan(call: Callable, tensors: list, plan: ZorroPlan) -> torch.Tensor:
    """Run a state-carrying scan over every ordinary row of ``plan``, each prompt once.

    ``tensors``: token-wise inputs ``[T, ...]`` (zero pads keep the state); ``call(padded, initial_state,
    output_final_state) -> (y [n, L, ...], final | None)`` with ``padded`` the tensors right padded ``[n, L, ...]``.
    Returns ``y [T, ...]``: prompts in one call, then the responses of all groups from ``final[row_group]``; prefix
    trees one call per node depth, every node from its parent's final state (the index sets of :mod:`.packed`)."""
    if plan.tree is not None:
        levels = tree_level_index(plan)
        outs, state = [], None
        for d, (index, valid, parent) in enumerate(levels):
            y, state = call([_gather_padded(t, index, valid) for t in tensors],
                            None if parent is None else state[parent], d + 1 < len(levels))  # y [n_d, L_d, ...]
            outs.append(y.reshape(-1, *y.shape[2:]))
        return torch.cat(outs)[_tree_out_index(plan, levels)]
    idx = recurrent_segment_index(plan)
    pi, pv = idx["prompt_index"], idx["prompt_valid"]
    y_p, s_p = call([_gather_padded(t, pi, pv) for t in tensors], None, True)  # y_p [G, Pmax, ...]
    outs = [y_p.reshape(-1, *y_p.shape[2:])]
    if plan.max_response_len > 0:
        ri, rv = idx["response_index"], idx["response_valid"]
        y_r, _ = call([_gather_padded(t, ri, rv) for t in tensors], s_p[plan.row_group], False)  # [B, Rmax, ...]
        outs.append(y_r.reshape(-1, *y_r.shape[2:]))
    return torch.cat(outs)[idx["padded_out"]]


def packed_ssd(kernel: Callable, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
               C: torch.Tensor, plan: ZorroPlan) -> torch.Tensor:
    """The Mamba-2 scan of every ordinary row, each prompt run once.

    Args:
        kernel: a scan with the module docstring's contract (e.g. :func:`chunk_ssd`).
        x: ``[T, H, P]``; dt: ``[T, H]`` (after softplus / clamp); A: ``[H]``; B, C: ``[T, G, N]`` — the packed row.

    Returns:
        ``y [T, H, P]`` (without ``D``) in the kernel's dtype. Two kernel calls (prompts ``[G, Pmax]``, then the
        responses of all groups ``[B, Rmax]``, right padded with zeros, each from ``final_state[row_group]`` of its
        prompt); prefix trees: one call per node depth, every node from its parent's final state.
    """
    def call(t, h0, final):
        return kernel(t[0], t[1], A, t[2], t[3], initial_state=h0, output_final_state=final)

    return _packed_scan(call, [x, dt, B, C], plan)


# ---------------------------------------------------------------------------------------------------- Mamba v1
def selective_scan(x, dt, A, B, C, initial_state=None, output_final_state=False):
    """The Mamba (v1) selective scan, step by step as transformers' torch path runs it. fp64 stays fp64, else fp32.

    Per channel ``d`` and state index ``n``: ``S[d, n] = exp(dt_t[d] A[d, n]) S[d, n] + dt_t[d] B_t[n] x_t[d];
    y_t[d] = sum_n S[d, n] C_t[n]`` — a per-element decay (``A [D, N]``), so no chunked (SSD) form. Shapes:
    ``x, dt [b, L, D]``, ``A [D, N]``, ``B, C [b, L, N]``, ``initial_state [b, D, N] | None``; returns ``(y [b, L, D]
    in the compute dtype, final [b, D, N] | None)``, ``y`` without the ``D`` skip term. A ``dt = 0`` token keeps the
    state (right padding is exact).
    """
    dt_ = _compute_dtype(x)
    b, L, D = x.shape
    x, dt, A, B, C = (t.to(dt_) for t in (x, dt, A, B, C))
    S = x.new_zeros(b, D, A.shape[-1]) if initial_state is None else initial_state.to(dt_)
    # the same ops, in the same order, as transformers' loop, so fp32 runs round as the stock path does
    dA = (A[None, None] * dt[..., None]).exp()  # [b, L, D, N]
    dBx = (dt[..., None] * B[:, :, None, :]) * x[..., None]  # [b, L, D, N]
    ys = []
    for t in range(L):
        S = dA[:, t] * S + dBx[:, t]
        ys.append(torch.matmul(S, C[:, t, :, None])[..., 0])  # [b, D]
    y = torch.stack(ys, 1) if ys else x.new_zeros(b, 0, D)
    return y, (S if output_final_state else None)


def packed_selective_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                          plan: ZorroPlan) -> torch.Tensor:
    """The Mamba (v1) selective scan of every ordinary row, each prompt run once (:func:`selective_scan` per
    segment: prompts, then every response from its prompt's final state; prefix trees down the trie).

    Args: x, dt ``[T, D]`` (dt after softplus); A ``[D, N]``; B, C ``[T, N]``. Returns ``y [T, D]`` (without ``D``).
    """
    def call(t, h0, final):
        return selective_scan(t[0], t[1], A, t[2], t[3], initial_state=h0, output_final_state=final)

    return _packed_scan(call, [x, dt, B, C], plan)
