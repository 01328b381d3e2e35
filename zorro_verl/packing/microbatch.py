"""Group-aware micro-batching and data-parallel balancing. Imports torch only.

A *group* is the set of rows sharing one prompt. A micro-batch pays each of its groups' prompts once, so its
deduplicated token cost is::

    cost(mb) = sum_{g in mb} P_g + sum_{b in mb} r_b

and a group split over m micro-batches (or m ranks) pays its prompt m times. Everything here therefore packs
*whole groups* and splits a group only when it cannot fit (counted in ``split_groups``).

Inputs are per-row: ``row_group [B]`` (any integer labels; equal label = same prompt), ``prompt_lens [B]`` (valid
prompt tokens of the row; equal within a group) and ``response_lens [B]`` (valid response tokens). Tensors or
sequences are accepted; they are read to the host once per call (the only sync).

Outputs are lists of row-index lists. Rows inside a micro-batch are in ascending original order; micro-batches
follow the groups' first appearance (fixed size) or the packing order (dynamic). :func:`restore_permutation`
gives the index that puts concatenated per-micro-batch outputs back into the original row order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Union

import torch

__all__ = [
    "GroupUnit",
    "MicroBatches",
    "fixed_size_microbatches",
    "dynamic_microbatches",
    "split_to_count",
    "restore_permutation",
    "microbatch_cost",
    "balance_groups_across_ranks",
    "DPBalance",
]

IntSeq = Union[torch.Tensor, Sequence[int]]


def _host_list(x: IntSeq, name: str) -> list[int]:
    if isinstance(x, torch.Tensor):
        if x.dim() != 1:
            raise ValueError(f"{name}: expected a 1-D tensor [B], got shape {tuple(x.shape)}.")
        return [int(v) for v in x.tolist()]
    return [int(v) for v in x]


def _inputs(row_group: IntSeq, prompt_lens: IntSeq, response_lens: IntSeq):
    g, p, r = (_host_list(row_group, "row_group"), _host_list(prompt_lens, "prompt_lens"),
               _host_list(response_lens, "response_lens"))
    if not (len(g) == len(p) == len(r)):
        raise ValueError(f"row_group / prompt_lens / response_lens: expected equal lengths [B], got {len(g)}, "
                         f"{len(p)}, {len(r)}.")
    if any(v < 0 for v in p) or any(v < 0 for v in r):
        raise ValueError("prompt_lens / response_lens: expected non-negative token counts.")
    return g, p, r


@dataclass
class GroupUnit:
    """Rows of one group (or of a piece of a split group) that travel together."""

    group: int
    rows: list[int]
    prompt_len: int
    response_tokens: int

    @property
    def cost(self) -> int:
        return self.prompt_len + self.response_tokens


@dataclass
class MicroBatches:
    """Result of a micro-batching call.

    ``batches``: row indices per micro-batch. ``split_groups``: number of groups whose rows ended up in more than one
    micro-batch. ``costs``: deduplicated token cost per micro-batch. ``ordinary_tokens``: ``sum_b P_b + r_b`` of
    the rows (what the ordinary forward processes); ``dedup_tokens``: ``sum(costs)``.
    """

    batches: list[list[int]]
    split_groups: int
    costs: list[int]
    ordinary_tokens: int
    dedup_tokens: int

    def __len__(self) -> int:
        return len(self.batches)


def _units(g: list[int], p: list[int], r: list[int]) -> list[GroupUnit]:
    """Groups in order of first appearance, rows ascending."""
    units: dict[int, GroupUnit] = {}
    for b, (gid, pl, rl) in enumerate(zip(g, p, r)):
        u = units.get(gid)
        if u is None:
            units[gid] = GroupUnit(gid, [b], pl, rl)
        else:
            if u.prompt_len != pl:
                raise ValueError(f"prompt_lens: rows {u.rows[0]} and {b} share group {gid} but have prompt lengths "
                                 f"{u.prompt_len} and {pl}; a group's rows must share one prompt.")
            u.rows.append(b)
            u.response_tokens += rl
    return list(units.values())


def _cost_of(rows: list[int], g: list[int], p: list[int], r: list[int]) -> int:
    seen: dict[int, int] = {}
    for b in rows:
        seen[g[b]] = p[b]
    return sum(seen.values()) + sum(r[b] for b in rows)


def microbatch_cost(rows: Sequence[int], row_group: IntSeq, prompt_lens: IntSeq, response_lens: IntSeq) -> int:
    """Deduplicated token cost of the micro-batch ``rows``: each distinct group's prompt once plus all responses."""
    g, p, r = _inputs(row_group, prompt_lens, response_lens)
    return _cost_of(list(rows), g, p, r)


def _finish(batches: list[list[int]], g, p, r) -> MicroBatches:
    batches = [sorted(mb) for mb in batches if mb]
    owners: dict[int, set] = {}
    for i, mb in enumerate(batches):
        for b in mb:
            owners.setdefault(g[b], set()).add(i)
    split = sum(1 for s in owners.values() if len(s) > 1)
    costs = [_cost_of(mb, g, p, r) for mb in batches]
    return MicroBatches(batches, split, costs, sum(p) + sum(r), sum(costs))



def fixed_size_microbatches(row_group: IntSeq, prompt_lens: IntSeq, response_lens: IntSeq,
                            micro_batch_size: int) -> MicroBatches:
    """Micro-batches of at most ``micro_batch_size`` rows that keep groups whole.

    Groups are placed in order of first appearance, first-fit into the open micro-batches (so small groups fill
    gaps). A group larger than ``micro_batch_size`` is cut into full chunks of ``micro_batch_size`` rows (plus a
    remainder that is placed like a group) and counted in ``split_groups``.
    """
    if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size < 1:
        raise ValueError(f"micro_batch_size: expected a positive int, got {micro_batch_size!r}.")
    g, p, r = _inputs(row_group, prompt_lens, response_lens)
    batches: list[list[int]] = []
    for u in _units(g, p, r):
        rows = u.rows
        while len(rows) > micro_batch_size:  # a whole micro-batch of this group
            batches.append(rows[:micro_batch_size])
            rows = rows[micro_batch_size:]
        for mb in batches:
            if len(mb) + len(rows) <= micro_batch_size:
                mb.extend(rows)
                break
        else:
            batches.append(list(rows))
    return _finish(batches, g, p, r)


def _split_unit_by_tokens(u: GroupUnit, r: list[int], max_tokens: int) -> list[GroupUnit]:
    """Cut a group whose cost exceeds ``max_tokens`` into pieces that each fit (each piece pays the prompt)."""
    pieces: list[GroupUnit] = []
    cur: list[int] = []
    tok = 0
    for b in u.rows:
        if u.prompt_len + r[b] > max_tokens:
            raise ValueError(f"max_token_len: row {b} alone needs {u.prompt_len + r[b]} tokens (prompt "
                             f"{u.prompt_len} + response {r[b]}) > max_token_len={max_tokens}. Raise "
                             "ppo_max_token_len_per_gpu / log_prob_max_token_len_per_gpu.")
        if cur and u.prompt_len + tok + r[b] > max_tokens:
            pieces.append(GroupUnit(u.group, cur, u.prompt_len, tok))
            cur, tok = [], 0
        cur.append(b)
        tok += r[b]
    if cur:
        pieces.append(GroupUnit(u.group, cur, u.prompt_len, tok))
    return pieces


def dynamic_microbatches(row_group: IntSeq, prompt_lens: IntSeq, response_lens: IntSeq, max_token_len: int,
                         min_num_micro_batches: int = 1, *, split_oversized_groups: bool = True) -> MicroBatches:
    """Micro-batches whose deduplicated token cost is at most ``max_token_len``, groups kept whole where they fit.

    Units (whole groups; a group costing more than the budget is cut into pieces that fit, counted as split) are
    packed first-fit-decreasing by cost. If fewer than ``min_num_micro_batches`` result (e.g. another DP rank needs
    more), :func:`split_to_count` splits the largest micro-batches until the count is reached. The budget is never
    exceeded — unless ``split_oversized_groups=False`` (the standalone API's soft budget): then a group costing
    more than the budget gets a micro-batch of its own, whole, since cutting it would recompute its prompt.
    """
    if isinstance(max_token_len, bool) or not isinstance(max_token_len, int) or max_token_len < 1:
        raise ValueError(f"max_token_len: expected a positive int, got {max_token_len!r}.")
    g, p, r = _inputs(row_group, prompt_lens, response_lens)
    units: list[GroupUnit] = []
    for u in _units(g, p, r):
        oversized = u.cost > max_token_len and split_oversized_groups
        units.extend(_split_unit_by_tokens(u, r, max_token_len) if oversized else [u])
    order = sorted(range(len(units)), key=lambda i: (-units[i].cost, units[i].rows[0]))  # stable FFD
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        u = units[i]
        for k in range(len(bins)):
            if loads[k] + u.cost <= max_token_len:
                bins[k].extend(u.rows)
                loads[k] += u.cost
                break
        else:
            bins.append(list(u.rows))
            loads.append(u.cost)
    mbs = _finish(bins, g, p, r)
    if len(mbs) < min_num_micro_batches:
        mbs = split_to_count(mbs, min_num_micro_batches, g, p, r)
    return mbs


def split_to_count(mbs: MicroBatches, count: int, row_group: IntSeq, prompt_lens: IntSeq,
                   response_lens: IntSeq) -> MicroBatches:
    """Split micro-batches until there are exactly ``count`` (needed so every DP rank runs the same number).

    Repeatedly takes the costliest micro-batch with >= 2 rows and halves it: between groups when it holds more than
    one (balanced by cost), else inside its single group (counted as split). Costs only decrease, so a token budget
    that held still holds. Raises if ``count`` exceeds the number of rows or is below the current count.
    """
    g, p, r = _inputs(row_group, prompt_lens, response_lens)
    batches = [list(mb) for mb in mbs.batches]
    if count < len(batches):
        raise ValueError(f"count: expected >= the current {len(batches)} micro-batches, got {count}.")
    if count > len(g):
        raise ValueError(f"count: {count} micro-batches requested but this rank has only {len(g)} rows; every "
                         "micro-batch needs at least one row. Use a smaller micro-batch count / more rows per rank.")
    while len(batches) < count:
        cand = [i for i, mb in enumerate(batches) if len(mb) >= 2]
        i = max(cand, key=lambda j: (_cost_of(batches[j], g, p, r), -j))
        mb = batches.pop(i)
        groups = _units([g[b] for b in mb], [p[b] for b in mb], [r[b] for b in mb])
        if len(groups) >= 2:  # LPT two-way split of whole groups
            a: list[int] = []
            b_: list[int] = []
            ca = cb = 0
            for u in sorted(groups, key=lambda u: -u.cost):
                rows = [mb[k] for k in u.rows]
                if ca <= cb:
                    a.extend(rows)
                    ca += u.cost
                else:
                    b_.extend(rows)
                    cb += u.cost
        else:
            half = len(mb) // 2
            a, b_ = mb[:half], mb[half:]
        batches[i:i] = [sorted(a), sorted(b_)]
    return _finish(batches, g, p, r)


def restore_permutation(batches: Sequence[Sequence[int]]) -> torch.Tensor:
    """Index that restores original row order: ``cat(outputs per micro-batch)[perm]`` is in original order.

    Args:
        batches: row indices per micro-batch; together a permutation of ``0..B-1``.

    Returns:
        ``[B] int64``.
    """
    order = [b for mb in batches for b in mb]
    n = len(order)
    if sorted(order) != list(range(n)):
        raise ValueError("batches: expected every row 0..B-1 exactly once across the micro-batches.")
    perm = torch.empty(n, dtype=torch.long)
    perm[torch.tensor(order, dtype=torch.long)] = torch.arange(n)
    return perm


@dataclass
class DPBalance:
    """Rows per data-parallel rank. ``ranks[k]``: row indices for rank ``k`` (ascending, siblings adjacent);
    ``costs[k]``: deduplicated token cost; ``split_groups``: groups spread over more than one rank."""

    ranks: list[list[int]]
    costs: list[int]
    split_groups: int

    def permutation(self) -> list[int]:
        """Global reorder index: rank 0's rows, then rank 1's, ... (what verl's ``batch.reorder`` expects)."""
        return [b for rows in self.ranks for b in rows]


def balance_groups_across_ranks(row_group: IntSeq, prompt_lens: IntSeq, response_lens: IntSeq, world_size: int,
                                equal_size: bool = True) -> DPBalance:
    """Bin-pack whole groups onto ``world_size`` ranks, balancing deduplicated token cost.

    With ``equal_size`` (verl dispatches equal DP chunks) each rank gets exactly ``B // world_size`` rows (the first
    ``B % world_size`` ranks one more). Groups are placed largest-cost first on the least-loaded rank that still has
    room for the whole group; groups that fit nowhere whole (larger than a rank's share, or left over by uneven
    sizes) are then cut into as few pieces as possible, filling the ranks with the most free rows first, and counted
    in ``split_groups``. Works for fewer groups than ranks and for ``B < world_size`` (some ranks get no rows).
    Without ``equal_size`` whole groups are never split and rank sizes may differ.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: expected a positive int, got {world_size!r}.")
    g, p, r = _inputs(row_group, prompt_lens, response_lens)
    B = len(g)
    units = sorted(_units(g, p, r), key=lambda u: (-u.cost, -len(u.rows), u.rows[0]))
    ranks: list[list[int]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    if equal_size:
        cap = [B // world_size + (1 if k < B % world_size else 0) for k in range(world_size)]
    else:
        cap = [B] * world_size
    deferred: list[GroupUnit] = []
    for u in units:
        fits = [k for k in range(world_size) if cap[k] - len(ranks[k]) >= len(u.rows)]
        if not fits:
            deferred.append(u)
            continue
        k = min(fits, key=lambda k: (loads[k], k))
        ranks[k].extend(u.rows)
        loads[k] += u.cost
    for u in deferred:  # only with equal_size: cut into the largest free slots
        rows = list(u.rows)
        while rows:
            k = max(range(world_size), key=lambda k: (cap[k] - len(ranks[k]), -loads[k], -k))
            free = cap[k] - len(ranks[k])
            assert free > 0, "row capacities sum to B"
            piece, rows = rows[:free], rows[free:]
            ranks[k].extend(piece)
            loads[k] += u.prompt_len + sum(r[b] for b in piece)
    ranks = [_siblings_adjacent(rows, g) for rows in ranks]
    owners: dict[int, set] = {}
    for k, rows in enumerate(ranks):
        for b in rows:
            owners.setdefault(g[b], set()).add(k)
    split = sum(1 for s in owners.values() if len(s) > 1)
    costs = [_cost_of(rows, g, p, r) for rows in ranks]
    return DPBalance(ranks, costs, split)


def _siblings_adjacent(rows: list[int], g: list[int]) -> list[int]:
    """Sort ``rows`` by (first row of their group, row): ascending, with siblings adjacent."""
    first: dict[int, int] = {}
    for b in rows:
        first[g[b]] = min(first.get(g[b], b), b)
    return sorted(rows, key=lambda b: (first[g[b]], b))
