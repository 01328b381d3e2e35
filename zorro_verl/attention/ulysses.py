"""Split attention under Ulysses sequence parallelism, and the gather of the head's rows (docs/design/verl.md).

Each rank of the SP group holds ``L = T_pad / sp`` tokens of the padded packed row (:mod:`zorro_verl.packing.ulysses`).
Per attention layer::

    q [1, Hq, L, D]  --all-to-all (scatter heads, gather sequence)-->  [1, Hq/sp, T_pad, D]   (k, v likewise)
    drop the pad -> attend(plan, backend) on the whole deduplicated row [T] for the local heads -> [1, T, Hq/sp, D]
    pad  --all-to-all (scatter sequence, gather heads)-->  [1, L, Hq, D]

With fewer KV heads than SP ranks each KV head is first repeated ``sp / Hkv`` times (consecutively, as verl's
``repeat_kv``), so every rank gets whole KV heads and its query heads still map to them in GQA order. The
all-to-all is an autograd Function whose backward is the opposite all-to-all (same collective, reversed dims).

:func:`gather_rows` all-gathers each rank's ``[N_s]`` head outputs into ``[N]`` (original row order); its backward
hands each rank its rows' gradient times ``sp`` — every SP rank computes the same loss on ``[N]`` and FSDP averages
gradients over all ``dp * sp`` ranks (verl's ``gather_outputs_and_unpad`` scales the same way).

:func:`sequence_to_heads` / :func:`heads_to_sequence` are the same exchange for ``[L, H, ...]`` tensors, used around
the gated delta-net's conv and recurrence (``integrations/transformers/hybrid.py``; heads independent there too).

Imports torch (``torch.distributed``) and the packing layer.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from zorro_verl.attention import AttentionFeatures, attend
from zorro_verl.packing import ZorroPlan
from zorro_verl.packing.ulysses import UlyssesShard

__all__ = ["check_ulysses_heads", "ulysses_attend", "gather_rows", "all_to_all_bytes",
           "linear_attention_all_to_all_bytes", "sequence_to_heads", "heads_to_sequence"]


def check_ulysses_heads(num_heads: int, num_kv_heads: int, sp_size: int) -> None:
    """Head counts Ulysses can shard (verl's own condition): ``Hq % sp == 0`` and ``Hkv % sp == 0`` or
    ``sp % Hkv == 0`` (then KV heads are repeated). Raises ``ValueError`` naming the fix otherwise."""
    if num_heads % sp_size:
        raise ValueError(f"ulysses_sequence_parallel_size: {sp_size} must divide the attention heads ({num_heads}); "
                         "choose a sequence-parallel size that divides the head count.")
    if num_kv_heads % sp_size and sp_size % num_kv_heads:
        raise ValueError(f"ulysses_sequence_parallel_size: {sp_size} and the key/value heads ({num_kv_heads}) must "
                         "divide one another (KV heads are repeated when there are fewer than SP ranks).")


class _AllToAll(torch.autograd.Function):
    """``x`` split into ``sp`` chunks along ``scatter_dim``, chunk ``s`` sent to rank ``s``, the received chunks
    concatenated along ``gather_dim`` (rank order). Backward: the opposite exchange."""

    @staticmethod
    def forward(ctx, x, group, scatter_dim: int, gather_dim: int):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, ctx.group, gather_dim, scatter_dim), None, None, None


def _all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    sp = dist.get_world_size(group)
    inputs = [t.contiguous() for t in torch.tensor_split(x, sp, scatter_dim)]
    outputs = [torch.empty_like(inputs[0]) for _ in range(sp)]
    dist.all_to_all(outputs, inputs, group=group)  # looked up per call: tests count its bytes
    return torch.cat(outputs, dim=gather_dim)


def all_to_all_bytes(local_len: int, sp_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                     element_size: int) -> int:
    """Bytes one rank hands to ``all_to_all`` per attention layer in the forward (q, k, v in, the output back;
    the backward sends the same again): the cost model's ``(2 Hq + 2 Hkv') * L * D`` elements, ``Hkv'`` after the
    KV repeat."""
    kv = sp_size if num_kv_heads < sp_size else num_kv_heads
    return (2 * num_heads + 2 * kv) * local_len * head_dim * element_size


def linear_attention_all_to_all_bytes(local_len: int, sp_size: int, num_k_heads: int, num_v_heads: int,
                                      head_k_dim: int, head_v_dim: int, element_size: int,
                                      decay_element_size: int) -> int:
    """Bytes one rank hands to ``all_to_all`` per gated delta-net layer in the forward (the backward sends the same
    again): the conv inputs ``q, k [L, Hk', Dk]``, ``v [L, Hv, Dv]`` and ``beta [L, Hv]`` in the model dtype, the
    log decay ``g [L, Hv]`` in ``decay_element_size`` (fp32, fp64 for fp64 models), and the output ``[L, Hv, Dv]``
    back; ``Hk' = Hk``, or ``Hv`` when ``sp`` does not divide the key heads (each repeated per value head)."""
    hk = num_k_heads if num_k_heads % sp_size == 0 else num_v_heads
    elements = 2 * hk * head_k_dim + 2 * num_v_heads * head_v_dim + num_v_heads
    return local_len * (elements * element_size + num_v_heads * decay_element_size)


def _repeat_kv(x: torch.Tensor, rep: int) -> torch.Tensor:
    """``[1, Hkv, L, D]`` -> ``[1, Hkv * rep, L, D]``, each head repeated ``rep`` times consecutively."""
    if rep == 1:
        return x
    _, h, L, d = x.shape
    return x[:, :, None].expand(1, h, rep, L, d).reshape(1, h * rep, L, d)


def ulysses_attend(plan: ZorroPlan, backend: str, shard: UlyssesShard, query: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, scaling: float, features: AttentionFeatures | None = None) -> torch.Tensor:
    """Split attention of ``plan`` over the SP group of ``shard``.

    Args:
        query: ``[1, Hq, L, D]``; key/value: ``[1, Hkv, L, D]`` — this rank's slice of the padded packed row.
        features: the layer's window / sinks ``[Hq]`` / soft-cap (:func:`~zorro_verl.attention.attend`); the sinks
            of this rank's heads are used (the slice keeps their gradient).

    Returns:
        ``[1, L, Hq, D]``: this rank's slice of the attention output.
    """
    sp, group, T = shard.sp_size, shard.group, shard.T
    hq, hkv = query.shape[1], key.shape[1]
    check_ulysses_heads(hq, hkv, sp)
    rep = sp // hkv if hkv < sp else 1
    key, value = _repeat_kv(key, rep), _repeat_kv(value, rep)
    # [1, H, L, D] -> [1, H/sp, T_pad, D], then drop the pad tokens
    q, k, v = (_AllToAll.apply(x, group, 1, 2)[:, :, :T] for x in (query, key, value))
    if features is not None and features.sinks is not None:
        features.check_heads(hq)
        h = hq // sp  # this rank's query heads: [rank * h, (rank + 1) * h)
        features = replace(features, sinks=features.sinks[shard.rank * h: (shard.rank + 1) * h])
    out = attend(plan, backend, q, k, v, scaling, features)  # [1, T, Hq/sp, D]
    pad = shard.padded_len - T
    if pad:
        out = torch.cat([out, out.new_zeros(1, pad, *out.shape[2:])], 1)
    return _AllToAll.apply(out, group, 1, 2)  # [1, T_pad, Hq/sp, D] -> [1, L, Hq, D]


def sequence_to_heads(x: torch.Tensor, shard: UlyssesShard) -> torch.Tensor:
    """``[L, H, ...]`` (this rank's tokens, every head) -> ``[T, H / sp, ...]`` (every token of the deduplicated row,
    pad dropped, this rank's heads ``[rank * H / sp, (rank + 1) * H / sp)``); autograd-aware (backward: the opposite
    exchange). Used around the gated delta-net, whose heads are independent (docs/design/verl.md)."""
    return _AllToAll.apply(x, shard.group, 1, 0)[: shard.T]


def heads_to_sequence(x: torch.Tensor, shard: UlyssesShard) -> torch.Tensor:
    """``[T, H / sp, ...]`` (this rank's heads) -> ``[L, H, ...]`` (this rank's tokens): the pad rows are added as
    zeros, then the exchange back (the inverse of :func:`sequence_to_heads`)."""
    pad = shard.padded_len - shard.T
    if pad:
        x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])], 0)
    return _AllToAll.apply(x, shard.group, 0, 1)


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, shard: UlyssesShard):
        ctx.shard = shard
        sp, m = shard.sp_size, shard.max_rows
        buf = local.new_zeros(m, *local.shape[1:])
        buf[: local.shape[0]] = local
        parts = [torch.empty_like(buf) for _ in range(sp)]
        dist.all_gather(parts, buf, group=shard.group)
        return torch.cat(parts, 0)[shard.gather_index]

    @staticmethod
    def backward(ctx, grad):
        shard = ctx.shard
        return grad[shard.rows] * shard.sp_size, None


def gather_rows(local: torch.Tensor, shard: UlyssesShard) -> torch.Tensor:
    """``[N_s, ...]`` values of this rank's head rows (``shard.rows`` order) -> ``[N, ...]``, original row order, on
    every rank of the SP group (backward: this rank's rows' gradient times ``sp``)."""
    if shard.max_rows == 0:  # no response token in the micro-batch: the same on every rank, nothing to exchange
        return local[shard.gather_index]
    return _GatherRows.apply(local, shard)
