"""Split attention under context parallelism (docs/design/megatron.md "Context parallelism").

Each rank of the CP group holds ``L`` tokens of the packed row (:func:`zorro_verl.packing.context_parallel.cp_shard`:
runs cut zigzag, so a prompt's tokens and its responses' tokens are spread over the ranks). A response's queries
need its whole prompt's keys wherever they live, so the keys and values are **all-gathered** over the group (one
collective of ``[L, 2 Hkv D]`` per layer; autograd-aware: the backward sums every rank's ``dk`` / ``dv`` into the
owner's rows, a reduce-scatter) and put back in packed order; then this rank's queries attend with the split
attention's rule at their global packed positions — a prompt token to its prompt's causal past, a response token
to its whole prompt and its own past, a trie node to its ancestors and its own past — which is the visibility
``plan.full_index()`` gives (the keys of an ordinary row up to the query's column). Exact, forward and backward:
every query sees exactly the keys it sees without CP, and each key's gradient is the sum of every query's.

This first version runs one dense masked call per rank (``[Hq, L, T]`` scores; ``sdpa`` or ``eager`` math): the
communication is the CP-optimal all-gather, the attention FLOPs are ``L x T`` per head rather than the causal
share. Pad tokens (``shard.valid`` False) attend to one key and output 0 (never read, no gradient to any key).

Imports torch and the packing layer.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zorro_verl.attention.features import NO_FEATURES, AttentionFeatures, dense_attention, position_visible
from zorro_verl.packing import ZorroPlan
from zorro_verl.packing.context_parallel import CPShard

__all__ = ["cp_attend", "cp_visible_mask", "gather_cp_rows", "CP_MATH"]

#: Backends that run under context parallelism, and the dense math each maps to.
CP_MATH = {"sdpa": "sdpa", "eager": "eager"}


class _GatherKV(torch.autograd.Function):
    """``x [L, F]`` on every rank -> ``[cp * L, F]`` rank-major; backward: the sum of every rank's gradient of this
    rank's rows (a reduce-scatter; on gloo, which has none, an all-reduce and this rank's slice)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        cp = dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(cp)]
        dist.all_gather(parts, x.contiguous(), group=group)  # looked up per call: tests count its bytes
        return torch.cat(parts, 0)

    @staticmethod
    def backward(ctx, grad):
        group = ctx.group
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        L = grad.shape[0] // cp
        if dist.get_backend(group) == "gloo":
            grad = grad.contiguous()
            dist.all_reduce(grad, group=group)
            return grad[rank * L: (rank + 1) * L], None
        out = grad.new_empty(L, *grad.shape[1:])
        dist.reduce_scatter_tensor(out, grad.contiguous(), group=group)
        return out, None


def cp_visible_mask(plan: ZorroPlan, shard: CPShard, features: AttentionFeatures = NO_FEATURES) -> torch.Tensor:
    """``[L, T] bool``: which packed keys each of this rank's queries attends to (True = attend). A query sees the
    packed tokens of an ordinary row containing it, up to its own column (``plan.full_index()``; a prompt token or
    a shared trie node reads the same keys from every row containing it); ``features``' window / chunk rule on the
    original positions is applied on top. Pad queries see key 0 only (their output is dropped). Memoised on the
    plan per shard layout and rule."""
    rule = features.position_rule

    def build():
        dev, T = plan.device, plan.T
        fi = plan.full_index()  # [B, S], -1 on pads
        B, S = fi.shape
        ok = fi >= 0
        row_of = torch.zeros(T, dtype=torch.long, device=dev)
        col_of = torch.zeros(T, dtype=torch.long, device=dev)
        rows = torch.arange(B, device=dev)[:, None].expand(B, S)[ok]
        cols = torch.arange(S, device=dev)[None, :].expand(B, S)[ok]
        row_of[fi[ok]] = rows  # any row containing the token (duplicates agree on the keys)
        col_of[fi[ok]] = cols
        q = shard.index.clamp(max=T - 1) if T else shard.index
        keys = fi[row_of[q]]  # [L, S]
        see = (keys >= 0) & (torch.arange(S, device=dev)[None, :] <= col_of[q][:, None])
        mask = torch.zeros(shard.local_len, T + 1, dtype=torch.bool, device=dev)
        mask.scatter_(1, torch.where(see, keys, T), True)
        mask = mask[:, :T]
        if rule is not None:
            pos = plan.position_ids
            mask &= position_visible(pos[q][:, None], pos[None, :], rule)
        mask[~shard.valid] = False
        if T:
            mask[~shard.valid, 0] = True
        return mask

    key = ("context_parallel", shard.cp_size, shard.rank, shard.local_len, rule)
    return plan.memo.get(key, build)


def cp_attend(plan: ZorroPlan, backend: str, shard: CPShard, query: torch.Tensor, key: torch.Tensor,
              value: torch.Tensor, scaling: float, features: AttentionFeatures | None = None) -> torch.Tensor:
    """Split attention of ``plan`` over the CP group of ``shard``.

    Args:
        backend: ``sdpa`` or ``eager`` (:data:`CP_MATH`); other backends are refused (ValueError).
        query: ``[1, Hq, L, D]``; key / value: ``[1, Hkv, L, D]`` (``value`` may have its own head dim) — this
            rank's tokens (``shard.index`` order).
        features: the layer's window / chunk / sinks ``[Hq]`` / soft-cap (:func:`~zorro_verl.attention.attend`).

    Returns:
        ``[1, L, Hq, Dv]``: this rank's attention output (0 on pad tokens).
    """
    if backend not in CP_MATH:
        raise ValueError(f"attention backend: expected one of {sorted(CP_MATH)} under context parallelism, got "
                         f"{backend!r}; zorro's CP attention all-gathers keys / values and runs one dense masked "
                         "call per rank. Set the zorro backend to 'sdpa' (or 'eager').")
    features = (features or NO_FEATURES).for_plan(plan)
    features.check_heads(query.shape[1])
    L, T = shard.local_len, plan.T
    if query.shape[2] != L or key.shape[2] != L or value.shape[2] != L:
        raise ValueError(f"query / key / value: expected this rank's {L} tokens on dim 2, got "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}.")
    hkv, dk, dv = key.shape[1], key.shape[3], value.shape[3]
    kv = torch.cat([key[0].transpose(0, 1).reshape(L, hkv * dk), value[0].transpose(0, 1).reshape(L, hkv * dv)], 1)
    if shard.cp_size > 1:
        kv = _GatherKV.apply(kv, shard.group)  # [cp * L, F], rank-major
    kv = kv.index_select(0, shard.gathered_index)  # [T, F] packed order (backward: index_add into the slots)
    k_all = kv[:, :hkv * dk].view(T, hkv, dk).transpose(0, 1)[None]
    v_all = kv[:, hkv * dk:].view(T, hkv, dv).transpose(0, 1)[None]
    mask = cp_visible_mask(plan, shard, features)
    out = dense_attention(query, k_all, v_all, scaling, mask=mask[None, None], math=CP_MATH[backend],
                          features=features)  # [1, Hq, L, Dv]
    out = out * shard.valid.to(out.dtype)[None, None, :, None]  # pad queries: output 0, no gradient to any key
    return out.transpose(1, 2)


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, shard: CPShard):
        ctx.shard = shard
        m = shard.max_rows
        buf = local.new_zeros(m, *local.shape[1:])
        buf[: local.shape[0]] = local
        parts = [torch.empty_like(buf) for _ in range(shard.cp_size)]
        dist.all_gather(parts, buf, group=shard.group)
        return torch.cat(parts, 0)[shard.gather_index]

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.shard.rows], None


def gather_cp_rows(local: torch.Tensor, shard: CPShard) -> torch.Tensor:
    """``[N_s, ...]`` values of this rank's head rows (``shard.rows`` order) -> ``[N, ...]``, original row order, on
    every rank of the CP group. Backward: the gradient of this rank's rows only — every rank computing the same loss
    on the gathered values, the sum of the ranks' parameter gradients (megatron's data-parallel reduction, which
    includes the CP ranks) is the gradient of one such loss."""
    if shard.cp_size == 1:
        return local[shard.gather_index]
    if shard.max_rows == 0:
        return local.new_zeros(0, *local.shape[1:])
    return _GatherRows.apply(local, shard)
