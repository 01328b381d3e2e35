"""The Mamba-2 SSM (state-space duality, "SSD") on the packed dedup row: prompts once, responses from their prompt's
final state.

A Mamba-2 layer (Mamba2, Bamba, Granite 4 hybrid, Nemotron-H, ...) mixes the sequence twice, both causally: a
depthwise causal conv over ``[x | B | C]`` (the same conv as the gated delta-net's: :func:`.packed.packed_causal_conv`)
and the selective scan, a recurrence per head over a state ``S [P, N]`` (``P`` head dim, ``N`` state size) with a
scalar per-token decay::

    S_t = exp(dt_t * A) S_{t-1} + dt_t * x_t B_t^T          y_t = S_t C_t          (+ D * x_t, token-wise)

``A < 0`` per head; ``dt [L, H]`` the step size after the model's softplus and clamp; ``B, C [L, G, N]`` shared by
the ``H / G`` heads of each group. As for the delta rule (:mod:`.packed`), each group's prompt runs once and every
response starts from its prompt's final state; autograd sums every response's use of that state back into the prompt.

Kernel contract (:func:`chunk_ssd`, the torch chunked scan zorro runs; :func:`recurrent_ssd_ref`, the slow
definition): ``fn(x [b, L, H, P], dt [b, L, H], A [H], B [b, L, G, N], C [b, L, G, N], initial_state=[b, H, P, N] |
None, output_final_state=bool) -> (y [b, L, H, P], final [b, H, P, N] | None)``, ``y`` without the ``D`` term.

Padding: a token with ``dt = 0`` leaves the state unchanged (decay ``exp(0) = 1``, update ``0``), so right-padding with
zeros is exact and a padded prompt's final state is its state after its last valid token.

Prefix trees (``plan.tree``): the state is carried down the trie, one kernel call per node depth, each node starting
from its parent's final state (the index sets of :mod:`.packed`).

This module imports torch and :mod:`zorro_verl.packing` only.
"""

from __future__ import annotations

from typing import Callable

import torch

from zorro_verl.packing import ZorroPlan
from zorro_verl.recurrent.packed import _gather_padded, _tree_out_index, recurrent_segment_index, tree_level_index

__all__ = ["packed_ssd", "chunk_ssd", "recurrent_ssd_ref"]


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
    if plan.tree is not None:
        levels = tree_level_index(plan)
        outs, state = [], None
        for d, (index, valid, parent) in enumerate(levels):
            y, state = kernel(*(_gather_padded(t, index, valid) for t in (x, dt)), A,
                              *(_gather_padded(t, index, valid) for t in (B, C)),
                              initial_state=None if parent is None else state[parent],
                              output_final_state=d + 1 < len(levels))  # y [n_d, L_d, H, P]
            outs.append(y.reshape(-1, *y.shape[2:]))
        return torch.cat(outs)[_tree_out_index(plan, levels)]
    idx = recurrent_segment_index(plan)
    pi, pv = idx["prompt_index"], idx["prompt_valid"]
    y_p, s_p = kernel(*(_gather_padded(t, pi, pv) for t in (x, dt)), A, *(_gather_padded(t, pi, pv) for t in (B, C)),
                      initial_state=None, output_final_state=True)  # y_p [G, Pmax, H, P], s_p [G, H, P, N]
    outs = [y_p.reshape(-1, *y_p.shape[2:])]
    if plan.max_response_len > 0:
        ri, rv = idx["response_index"], idx["response_valid"]
        y_r, _ = kernel(*(_gather_padded(t, ri, rv) for t in (x, dt)), A, *(_gather_padded(t, ri, rv) for t in (B, C)),
                        initial_state=s_p[plan.row_group], output_final_state=False)  # [B, Rmax, H, P]
        outs.append(y_r.reshape(-1, *y_r.shape[2:]))
    return torch.cat(outs)[idx["padded_out"]]
