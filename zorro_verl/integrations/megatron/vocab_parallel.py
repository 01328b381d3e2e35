"""Response log-probs and entropy from megatron's vocabulary-parallel logits, without gathering the vocabulary
(docs/design/logprob.md for the math, megatron.md).

Each tensor-parallel rank holds ``logits [N, V/tp]``, the columns ``[vocab_start, vocab_start + V/tp)``. Per row the
rank computes, in row blocks, its local max ``m_r``, ``S_r = sum exp(z - m_r)`` and ``Z_r = sum exp(z - m_r) z`` (``z``
the temperature-scaled logits in the softmax dtype, :func:`~zorro_verl.logprob.scaled_logits`); one all-gather of
``[3, N]`` combines them (``m = max m_r``, ``S = sum S_r exp(m_r - m)``, likewise ``Z``): ``lse = m + log S``,
``s = Z / S`` (the softmax-weighted mean logit), ``entropy = lse - s``; the target logit comes from the rank that
holds it (one all-reduce of ``[N]``), ``log_prob = z_target - lse``. Backward needs no communication: with
``p = exp(z - lse)`` on the rank's columns, ``dz = g_lp (onehot - p) - g_ent p (z - s)``, recomputed block by block
from the saved raw logits (nothing ``[N, V/tp]`` is saved beyond the logits themselves). Exact up to the
reassociation of the sums over ranks (fp64: round-off).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from zorro_verl.logprob import DEFAULT_CHUNK, check_temperature_op, scaled_logits, unscaled_grad

__all__ = ["vocab_parallel_logprobs"]


def _blocks(n: int, chunk: int):
    for a in range(0, n, chunk):
        yield a, min(n, a + chunk)


def _local_target(z: torch.Tensor, targets: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``z [c, Vl]``, ``targets [c]`` (global ids) -> ``(z at the target where this rank holds it, else 0 [c],
    held [c] bool)``."""
    local = targets - start
    held = (local >= 0) & (local < z.shape[1])
    zt = z.gather(1, local.clamp(0, z.shape[1] - 1)[:, None])[:, 0]
    return torch.where(held, zt, torch.zeros_like(zt)), held


class _VocabParallelLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, temperature, calculate_entropy, chunk, op, group, start):
        n = logits.shape[0]
        sd = scaled_logits(logits[:0], 1.0, "upcast").dtype  # the softmax dtype (fp32; fp64 for fp64 logits)
        stats = logits.new_empty((3, n), dtype=sd)  # local max, sum exp(z - m_r), sum exp(z - m_r) z
        zt = logits.new_empty(n, dtype=sd)
        for a, b in _blocks(n, chunk):
            z = scaled_logits(logits[a:b], temperature, op)
            m = z.max(1).values
            e = torch.exp(z - m[:, None])
            stats[0, a:b] = m
            stats[1, a:b] = e.sum(1)
            stats[2, a:b] = (e * z).sum(1)
            zt[a:b] = _local_target(z, targets[a:b], start)[0]
        world = dist.get_world_size(group)
        every = [torch.empty_like(stats) for _ in range(world)]
        dist.all_gather(every, stats, group=group)
        every = torch.stack(every)  # [tp, 3, N]
        m = every[:, 0].max(0).values
        w = torch.exp(every[:, 0] - m)  # [tp, N]
        S = (every[:, 1] * w).sum(0)
        s = (every[:, 2] * w).sum(0) / S
        lse = m + torch.log(S)
        dist.all_reduce(zt, group=group)
        ctx.save_for_backward(logits, targets, lse, s)
        ctx.cfg = (temperature, chunk, op, start)
        ctx.mark_non_differentiable(targets)
        return zt - lse, lse - s

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        logits, targets, lse, s = ctx.saved_tensors
        temperature, chunk, op, start = ctx.cfg
        grad = torch.empty_like(logits)
        for a, b in _blocks(logits.shape[0], chunk):
            z = scaled_logits(logits[a:b], temperature, op)
            p = torch.exp(z - lse[a:b, None])
            dz = torch.zeros_like(z)
            if g_ent is not None:
                dz -= g_ent[a:b, None] * p * (z - s[a:b, None])
            if g_lp is not None:
                dz -= g_lp[a:b, None] * p
                local = (targets[a:b] - start).clamp(0, z.shape[1] - 1)
                held = _local_target(z, targets[a:b], start)[1]
                dz.scatter_add_(1, local[:, None], torch.where(held, g_lp[a:b], torch.zeros_like(g_lp[a:b]))[:, None])
            grad[a:b] = unscaled_grad(dz, logits.dtype, temperature, op)
        return grad, None, None, None, None, None, None, None


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, group, vocab_start: int,
                            temperature: float = 1.0, calculate_entropy: bool = False,
                            chunk_size: int = DEFAULT_CHUNK,
                            temperature_op: str = "upcast") -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs (and entropy) of ``targets [N] int64`` (global vocabulary ids) from this rank's vocabulary slice
    ``logits [N, V/tp]`` (columns ``[vocab_start, vocab_start + V/tp)``); every rank of ``group`` calls with the same
    rows and targets and gets the same ``(log_probs [N], entropy [N] | None)`` in the softmax dtype (fp32; fp64 for
    fp64 logits). The gradient reaches each rank's own slice only. ``temperature_op`` as in
    :data:`~zorro_verl.logprob.TEMPERATURE_OPS`; ``chunk_size`` rows per block of the ``[c, V/tp]`` temporaries."""
    op = check_temperature_op(temperature_op)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature: expected a float > 0, got {temperature!r}.")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size: expected an int >= 1, got {chunk_size!r}.")
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"logits / targets: expected [N, V/tp] and [N], got {tuple(logits.shape)} and "
                         f"{tuple(targets.shape)}.")
    logp, ent = _VocabParallelLogprob.apply(logits, targets, float(temperature), calculate_entropy, chunk_size, op,
                                            group, int(vocab_start))
    return logp, (ent if calculate_entropy else None)
