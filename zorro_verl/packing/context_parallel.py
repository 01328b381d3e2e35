"""Context-parallel layout of a plan's packed row (docs/design/megatron.md "Context parallelism").

Every rank of a context-parallel (CP) group holds the same micro-batch and builds the same plan. The packed row
``[T]`` (each prompt once, then its responses; a prefix tree's DFS layout) is split over the ``cp`` ranks, each
running ``L`` tokens (``L`` a multiple of ``multiple``: the tensor-parallel size under sequence parallelism); the
attention all-gathers keys / values over the group (:mod:`zorro_verl.attention.context_parallel`).

**Load balance.** A packed token at position ``p`` (its place in its ordinary row) attends to ``p + 1`` keys in the
split attention — a prompt token to its prompt's causal past, a response token to its whole prompt and its own past
— so its causal cost is ``p + 1`` whatever the sharing mode. The row is cut into *runs*: maximal stretches whose
positions count up by one (a prompt and the response packed right after it, the next response starting again at
``P``, a trie node continuing its parent). Each run is cut into ``2 cp`` near-equal pieces and rank pair ``k`` gets
piece ``k`` and its mirror ``2 cp - 1 - k`` (the zigzag verl uses for ordinary rows, so the cheap front and the
expensive back of a run land together); which rank takes which pair is chosen run by run, largest pair to the rank
with the fewest tokens so far, keeping the ranks' token counts within a few tokens of each other without padding
each run::

    run (positions 0..7), cp = 2:  pieces [0 1] [2 3] [4 5] [6 7] -> pair 0 = [0 1]+[6 7], pair 1 = [2 3]+[4 5]
    costs: pair 0 = 1+2+7+8 = 18, pair 1 = 3+4+5+6 = 18

Each rank keeps its tokens in packed order, right padded to ``L`` (pad: id 0, position 0, attends to nothing).

This module imports torch only; :func:`cp_split` makes the layout's host sync (the run lengths).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from zorro_verl.packing.plan import ZorroPlan

__all__ = ["CPShard", "cp_split", "cp_shard", "cp_costs", "cp_kv_bytes", "stock_cp_local_tokens"]


def _check_int(name: str, value, lo: int, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{name}: expected an int >= {lo} ({what}), got {value!r}.")


def cp_split(position_ids: torch.Tensor, cp_size: int, multiple: int = 1) -> torch.Tensor:
    """Which packed tokens each CP rank runs.

    Args:
        position_ids: ``[T] int64``, each packed token's position in its ordinary row (``plan.position_ids``).
        cp_size: ranks in the CP group (``>= 1``).
        multiple: ``L`` is rounded up to a multiple of it (the TP size under sequence parallelism).

    Returns:
        ``index [cp_size, L] int64``: rank ``r``'s tokens as packed positions, ascending, padded with ``T``. Every
        packed token appears exactly once. One host sync (the positions, to find the runs).
    """
    _check_int("cp_size", cp_size, 1, "context_parallel_size")
    _check_int("multiple", multiple, 1, "the length every rank's slice is a multiple of")
    if position_ids.dim() != 1:
        raise ValueError(f"position_ids: expected [T], got {tuple(position_ids.shape)}.")
    T = position_ids.numel()
    dev = position_ids.device
    pos = position_ids.tolist()  # the one host sync
    starts = [i for i in range(T) if i == 0 or pos[i] != pos[i - 1] + 1] + [T]
    owner = [0] * T
    counts = [0] * cp_size
    k2 = 2 * cp_size
    for a, b in zip(starts[:-1], starts[1:]):
        n = b - a
        cut = [a + (j * n) // k2 for j in range(k2 + 1)]  # piece j = [cut[j], cut[j+1])
        pairs = [(cut[k + 1] - cut[k] + cut[k2 - k] - cut[k2 - 1 - k], k) for k in range(cp_size)]
        # the largest pair to the rank with the fewest tokens so far (ties: lower pair / rank first)
        ranks = sorted(range(cp_size), key=lambda r: (counts[r], r))
        for (size, k), r in zip(sorted(pairs, key=lambda sk: (-sk[0], sk[1])), ranks):
            counts[r] += size
            for lo, hi in ((cut[k], cut[k + 1]), (cut[k2 - 1 - k], cut[k2 - k])):
                owner[lo:hi] = [r] * (hi - lo)
    L = max(counts) if counts else 0
    L = max(multiple, -(-L // multiple) * multiple)
    index = torch.full((cp_size, L), T, dtype=torch.long)
    order = torch.argsort(torch.tensor(owner, dtype=torch.long), stable=True)  # by rank, packed order inside
    for r, mine in enumerate(order.split(counts)):
        index[r, :mine.numel()] = mine
    return index.to(dev)


def cp_costs(position_ids: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Causal attention cost per CP rank: ``sum (p + 1)`` over each rank's tokens (keys each query attends to),
    ``index [cp, L]`` from :func:`cp_split` -> ``[cp] int64``."""
    cost = torch.cat([position_ids + 1, position_ids.new_zeros(1)])  # the pad slot T costs 0
    return cost[index].sum(1)


@dataclass
class CPShard:
    """This rank's part of a plan under context parallelism.

    Python ints: ``cp_size``, ``rank`` (in the CP group), ``T`` (the plan's tokens), ``local_len`` (``L``),
    ``padded_len`` (``cp * L``, the all-gathered buffer), ``row_counts`` (head rows per rank, a tuple of ``cp``
    ints), ``max_rows`` (their maximum). ``group``: the CP process group (opaque here).

    Tensors (on the plan's device):

    * ``index [L] int64``: this rank's packed positions, ascending (pad: ``T``); ``valid [L] bool``.
    * ``input_ids [L]``, ``position_ids [L]``: this rank's tokens (pad: id 0, position 0).
    * ``gathered_index [T] int64``: where each packed token sits in the all-gathered rank-major ``[cp * L]`` buffer.
    * ``rows [N_s]``: the entries of ``[N]`` (original row order) whose predicting token this rank holds, ascending;
      ``logit_index [N_s]``: their place in this rank's slice; ``target_ids [N_s]``.
    * ``gather_index [N]``: each entry's place in the all-gathered ``[cp * max_rows]`` head values.
    * ``head_index [Nh_s]``, ``head_inverse [N_s]`` (prefix-tree plans only, else None): the distinct local
      predicting rows (the head runs there once) and each output's row among them.
    """

    cp_size: int
    rank: int
    T: int
    local_len: int
    padded_len: int
    row_counts: tuple
    max_rows: int
    group: Any
    index: torch.Tensor
    valid: torch.Tensor
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    gathered_index: torch.Tensor
    rows: torch.Tensor
    logit_index: torch.Tensor
    target_ids: torch.Tensor
    gather_index: torch.Tensor
    head_index: Optional[torch.Tensor] = None
    head_inverse: Optional[torch.Tensor] = None


def cp_shard(plan: ZorroPlan, cp_size: int, rank: int, group: Any = None, multiple: int = 1) -> CPShard:
    """The tokens and head rows CP rank ``rank`` of ``cp_size`` runs (layout: :func:`cp_split`).

    Args:
        plan: the micro-batch's plan (identical on every rank of the CP group).
        cp_size: ranks in the CP group; rank: this rank's index in it.
        group: the CP process group, carried for the collectives (not used here).
        multiple: the slice length is a multiple of it (the TP size under sequence parallelism).

    Returns:
        A :class:`CPShard`. Host syncs: :func:`cp_split`'s and the per-rank head-row counts (a tree plan's local
        ``unique`` is a third).
    """
    _check_int("cp_size", cp_size, 1, "context_parallel_size")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < cp_size:
        raise ValueError(f"rank: expected an int in [0, {cp_size}) (the rank in the CP group), got {rank!r}.")
    dev, T = plan.device, plan.T
    split = cp_split(plan.position_ids, cp_size, multiple)  # [cp, L]
    L = split.shape[1]
    flat = split.flatten()
    slots = torch.arange(flat.numel(), device=dev)
    gathered_index = torch.empty(T + 1, dtype=torch.long, device=dev)
    gathered_index[flat] = slots  # the pad slots all write T (dropped)
    gathered_index = gathered_index[:T]
    rank_of = torch.div(gathered_index, L, rounding_mode="floor")  # [T]
    local_of = gathered_index - rank_of * L
    index = split[rank]
    valid = index < T
    ids = torch.cat([plan.input_ids, plan.input_ids.new_zeros(1)])[index]
    pos = torch.cat([plan.position_ids, plan.position_ids.new_zeros(1)])[index]
    owner = rank_of[plan.logit_index]  # [N]
    counts = torch.bincount(owner, minlength=cp_size)
    row_counts = tuple(counts.tolist())  # host sync
    max_rows = max(row_counts) if row_counts else 0
    order = torch.argsort(owner, stable=True)  # [N] grouped by owner, original order inside
    first = torch.cumsum(counts, 0) - counts
    slot = torch.empty_like(order)
    slot[order] = torch.arange(plan.N, device=dev) - first[owner[order]] + owner[order] * max_rows
    lo = sum(row_counts[:rank])
    rows = order[lo: lo + row_counts[rank]]
    local = local_of[plan.logit_index[rows]]
    head_index = head_inverse = None
    if plan.head_index is not None:
        head_index, head_inverse = torch.unique(local, return_inverse=True)
    return CPShard(cp_size=cp_size, rank=rank, T=T, local_len=L, padded_len=cp_size * L, row_counts=row_counts,
                   max_rows=max_rows, group=group, index=index, valid=valid, input_ids=ids, position_ids=pos,
                   gathered_index=gathered_index, rows=rows, logit_index=local, target_ids=plan.target_ids[rows],
                   gather_index=slot, head_index=head_index, head_inverse=head_inverse)


def cp_kv_bytes(local_len: int, cp_size: int, num_kv_heads: int, head_dim: int, element_size: int) -> int:
    """Bytes one rank receives per attention layer in the forward when keys and values are all-gathered over the
    CP group: the other ``cp - 1`` ranks' ``L`` tokens of ``k`` and ``v``, ``2 (cp - 1) L Hkv D`` elements
    (``Hkv``: the rank's key/value heads, after tensor parallelism). The backward reduce-scatters ``dk`` / ``dv``:
    the same volume again. Transformer Engine's CP ring (``p2p``) passes each rank's ``k`` / ``v`` chunk ``cp - 1``
    times, and its ``all_gather`` type gathers them: the same formula on its own ``L``."""
    for name, v in (("local_len", local_len), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                    ("element_size", element_size)):
        _check_int(name, v, 0, "a size")
    _check_int("cp_size", cp_size, 1, "context_parallel_size")
    return 2 * (cp_size - 1) * local_len * num_kv_heads * head_dim * element_size


def stock_cp_local_tokens(seq_lens, cp_size: int, tp_size: int = 1) -> int:
    """Tokens per CP rank of the stock layout of the same micro-batch: verl's THD preprocessing pads every ordinary
    row (``P_b + r_b`` tokens, ``seq_lens``) to a multiple of ``tp * cp * 2`` (zigzag; ``tp * cp`` at ``cp = 1``) and
    gives each rank ``1 / cp`` of every row."""
    _check_int("cp_size", cp_size, 1, "context_parallel_size")
    _check_int("tp_size", tp_size, 1, "tensor_model_parallel_size")
    align = tp_size * cp_size * (2 if cp_size > 1 else 1)
    total = sum(-(-int(n) // align) * align for n in seq_lens)
    return total // cp_size
