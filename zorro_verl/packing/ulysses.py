"""Ulysses sequence-parallel layout of a plan's packed row (docs/design/verl.md "Ulysses sequence parallelism").

Every rank of a sequence-parallel (SP) group holds the same micro-batch and builds the same plan. The packed row
``[T]`` is right padded to ``T_pad = ceil(T / sp) * sp`` and rank ``s`` runs the tokens
``[s * L, (s + 1) * L)``, ``L = T_pad / sp``::

    packed row:  [ P0 | R00 | R01 | P1 | R10 | pad ]      T = 11 tokens, sp = 2 -> T_pad = 12, L = 6
    rank 0:      [ 0 .. 5 ]      rank 1: [ 6 .. 11 ]   (the pad: id 0, position 0, never read)

The LM head runs on each rank only at the response-predicting rows it holds (``plan.logit_index`` in its range);
:attr:`UlyssesShard.gather_index` puts the all-gathered per-rank values back into ``[N]``, original row order.

Prefix-tree plans (``plan.tree``) shard the same way: the packed row is the trie's DFS layout, every rank runs its
slice, and the attention / recurrence backends see the whole row after the exchange. A predicting position shared by
several outputs lies on exactly one rank, which runs the head there once (``head_index [Nh_s]``, its distinct local
rows) and hands each of its outputs that row (``head_inverse [N_s]``) with the output's own target.

This module imports torch only; :func:`ulysses_shard` does its one host sync (the per-rank row counts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from zorro_verl.packing.plan import ZorroPlan

__all__ = ["UlyssesShard", "ulysses_shard"]


@dataclass
class UlyssesShard:
    """This rank's part of a plan under Ulysses SP.

    Python ints: ``sp_size``, ``rank`` (in the SP group), ``T`` (the plan's tokens), ``padded_len`` (``T_pad``),
    ``local_len`` (``L = T_pad / sp``), ``start`` (``rank * L``), ``row_counts`` (``N_s`` per rank, a tuple of
    ``sp`` ints), ``max_rows`` (their maximum). ``group``: the SP process group (opaque here).

    Tensors (int64, on the plan's device):

    * ``input_ids [L]``, ``position_ids [L]``: this rank's slice of the padded packed row (pad: id 0, position 0).
    * ``rows [N_s]``: the entries of ``[N]`` (original row order) whose predicting row this rank holds, ascending.
    * ``logit_index [N_s]``: their predicting rows, local to the slice (``plan.logit_index[rows] - start``).
    * ``target_ids [N_s]``: the tokens they predict.
    * ``gather_index [N]``: for every entry of ``[N]``, its place in the all-gathered ``[sp * max_rows]`` values
      (rank ``s``'s ``j``-th row sits at ``s * max_rows + j``).
    * ``head_index [Nh_s]``, ``head_inverse [N_s]`` (prefix-tree plans only, else None): the distinct local
      positions among ``logit_index`` (ascending; the head runs there once) and each output's row among them.
    """

    sp_size: int
    rank: int
    T: int
    padded_len: int
    local_len: int
    start: int
    row_counts: tuple
    max_rows: int
    group: Any
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    rows: torch.Tensor
    logit_index: torch.Tensor
    target_ids: torch.Tensor
    gather_index: torch.Tensor
    head_index: Optional[torch.Tensor] = None
    head_inverse: Optional[torch.Tensor] = None


def ulysses_shard(plan: ZorroPlan, sp_size: int, rank: int, group: Any = None) -> UlyssesShard:
    """The slice of ``plan``'s packed row and the head rows SP rank ``rank`` of ``sp_size`` runs.

    Args:
        plan: the micro-batch's plan (identical on every rank of the SP group).
        sp_size: ranks in the SP group (``>= 1``).
        rank: this rank's index in the SP group, ``0 <= rank < sp_size``.
        group: the SP process group, carried for the collectives (not used here).

    Returns:
        An :class:`UlyssesShard`. One host sync (the per-rank row counts; a tree plan's local ``unique`` is a
        second one).
    """
    if isinstance(sp_size, bool) or not isinstance(sp_size, int) or sp_size < 1:
        raise ValueError(f"sp_size: expected an int >= 1 (ulysses_sequence_parallel_size), got {sp_size!r}.")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < sp_size:
        raise ValueError(f"rank: expected an int in [0, {sp_size}) (the rank in the SP group), got {rank!r}.")
    dev = plan.device
    T = plan.T
    L = -(-T // sp_size)  # ceil
    Tp = L * sp_size
    start = rank * L
    ids = torch.zeros(Tp, dtype=torch.long, device=dev)
    pos = torch.zeros(Tp, dtype=torch.long, device=dev)
    ids[:T] = plan.input_ids
    pos[:T] = plan.position_ids
    owner = torch.div(plan.logit_index, L, rounding_mode="floor")  # [N] SP rank holding each predicting row
    counts = torch.bincount(owner, minlength=sp_size)
    row_counts = tuple(counts.tolist())  # the one host sync
    max_rows = max(row_counts) if row_counts else 0
    # j-th entry (in original order) among those of its owner rank -> slot owner * max_rows + j
    order = torch.argsort(owner, stable=True)  # [N] grouped by owner, original order inside
    first = torch.cumsum(counts, 0) - counts  # [sp]
    slot = torch.empty_like(order)
    slot[order] = torch.arange(plan.N, device=dev) - first[owner[order]] + owner[order] * max_rows
    lo = sum(row_counts[:rank])
    rows = order[lo: lo + row_counts[rank]]
    local = plan.logit_index[rows] - start  # [N_s]
    head_index = head_inverse = None
    if plan.head_index is not None:  # a tree: outputs sharing a position read one head row (on this rank only)
        head_index, head_inverse = torch.unique(local, return_inverse=True)  # [Nh_s], [N_s]
    return UlyssesShard(
        sp_size=sp_size, rank=rank, T=T, padded_len=Tp, local_len=L, start=start, row_counts=row_counts,
        max_rows=max_rows, group=group, input_ids=ids[start: start + L], position_ids=pos[start: start + L],
        rows=rows, logit_index=local, target_ids=plan.target_ids[rows], gather_index=slot,
        head_index=head_index, head_inverse=head_inverse)
