"""Lightning (linear) attention on the packed dedup row: prompts once, responses from their prompt's final state.

MiniMax-Text-01 / MiniMax-M1 interleave softmax attention with *lightning attention*: per head, a linear attention
with a constant scalar decay ``s > 0`` (the head's slope rate), over a state ``S [Dk, Dv]``::

    S_t = exp(-s) S_{t-1} + k_t v_t^T          o_t = q_t S_t

(transformers' ``MiniMaxLightningAttention`` computes it block by block — intra-block ``(q k^T * D) v`` with
``D[i, j] = exp(-s (i - j))``, inter-block ``q_i exp(-s (i+1)) S`` — which is this recurrence in exact arithmetic for
any block size). It is the Mamba-2 scan (:mod:`.ssd`) with ``dt = 1``, ``A = -s``, ``x = v``, ``B = k``, ``C = q`` and
one ``B`` / ``C`` group per head (its state is ``S^T [Dv, Dk]``), so the packed version runs
:func:`~zorro_verl.recurrent.ssd.packed_ssd` with :func:`~zorro_verl.recurrent.ssd.chunk_ssd`: each group's prompt once,
every response from ``final_state[row_group]`` of its prompt; prefix trees one call per node depth.

Padding: a pad gets ``dt = 0`` (the ssd gather zeroes it), which keeps the state — exact.

This module imports torch and :mod:`zorro_verl.packing` only.
"""

from __future__ import annotations

import functools

import torch

from zorro_verl.packing import ZorroPlan
from zorro_verl.recurrent.ssd import chunk_ssd, packed_ssd

__all__ = ["packed_lightning_attention", "recurrent_lightning_ref"]


def recurrent_lightning_ref(q, k, v, slope, initial_state=None, output_final_state=False):
    """Step-by-step lightning attention (the definition; slow, for tests), in the inputs' dtype.

    Args:
        q, k: ``[b, L, H, Dk]``; v: ``[b, L, H, Dv]``; slope: ``[H]`` (decay rate ``s > 0``);
        initial_state: ``[b, H, Dk, Dv]`` or None (zeros).

    Returns:
        ``(o [b, L, H, Dv], final [b, H, Dk, Dv] | None)`` with ``S_t = exp(-s) S_{t-1} + k_t v_t^T``, ``o_t = q_t
        S_t``.
    """
    b, L, H, Dk = q.shape
    S = q.new_zeros(b, H, Dk, v.shape[-1]) if initial_state is None else initial_state
    decay = torch.exp(-slope.to(q.dtype))[None, :, None, None]  # [1, H, 1, 1]
    outs = []
    for t in range(L):
        S = decay * S + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append((q[:, t, :, :, None] * S).sum(-2))  # [b, H, Dv]
    o = torch.stack(outs, 1) if outs else v.new_zeros(b, 0, H, v.shape[-1])
    return o, (S if output_final_state else None)


def packed_lightning_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor,
                               plan: ZorroPlan, *, chunk_size: int = 64) -> torch.Tensor:
    """Lightning attention of every ordinary row, each prompt run once.

    Args:
        q, k: ``[T, H, Dk]``; v: ``[T, H, Dv]`` — the packed row; slope: ``[H]`` (the decay rate ``s``).
        chunk_size: the scan's chunk (any value gives the same result up to rounding).

    Returns:
        ``o [T, H, Dv]``, fp64 for fp64 inputs, else fp32 (the scan's compute dtype); the caller casts back.
    """
    T, H, _ = q.shape
    dt = torch.ones(T, H, dtype=q.dtype, device=q.device)  # pads get dt = 0 from the gather (state kept)
    kernel = functools.partial(chunk_ssd, chunk_size=chunk_size)
    # Mamba-2 view: x = v [T, H, P=Dv], B = k and C = q [T, G=H, N=Dk], A = -s
    return packed_ssd(kernel, v, dt, -slope.reshape(H), k, q, plan)
