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

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Union

import torch

from zorro_verl.packing.placement import best_whole_placement

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
    "regroup_within_slots",
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
                         min_num_micro_batches: int = 1, *, split_oversized_groups: bool = True,
                         split_response_lens: IntSeq | None = None) -> MicroBatches:
    """Micro-batches whose deduplicated token cost is at most ``max_token_len``, groups kept whole where they fit.

    Units (whole groups; a group costing more than the budget is cut into pieces that fit, counted as split) are
    packed first-fit-decreasing by cost. If fewer than ``min_num_micro_batches`` result (e.g. another DP rank needs
    more), :func:`split_to_count` splits the largest micro-batches until the count is reached. The budget is never
    exceeded — unless ``split_oversized_groups=False`` (the standalone API's soft budget): then a group costing
    more than the budget gets a micro-batch of its own, whole, since cutting it would recompute its prompt.

    ``split_response_lens [B]``: what each row costs beyond the shared prompt in a *piece* of a cut group, when that
    is more than its share in the whole group (prefix trees: a cluster's inner nodes are paid by one row each in
    ``response_lens``, by every row of a piece here; :func:`~zorro_verl.packing.tree.tree_row_costs`); default
    ``response_lens``. The result's ``costs`` are then the packing's own loads: exact for whole clusters, an upper
    bound of the tree's tokens for a micro-batch holding a piece of a cut cluster.
    """
    if isinstance(max_token_len, bool) or not isinstance(max_token_len, int) or max_token_len < 1:
        raise ValueError(f"max_token_len: expected a positive int, got {max_token_len!r}.")
    g, p, r = _inputs(row_group, prompt_lens, response_lens)
    r_split = r if split_response_lens is None else _inputs(row_group, prompt_lens, split_response_lens)[2]
    units: list[GroupUnit] = []
    for u in _units(g, p, r):
        oversized = u.cost > max_token_len and split_oversized_groups
        units.extend(_split_unit_by_tokens(u, r_split, max_token_len) if oversized else [u])
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
    if split_response_lens is not None:
        # A piece of a cut cluster may pay inner nodes that response_lens charges to a row outside the piece: the
        # packing loads (what the budget was checked against) are the honest, conservative costs. For whole
        # clusters they equal _finish's costs.
        mbs.costs, mbs.dedup_tokens = loads, sum(loads)
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
    """Rows per data-parallel rank.

    ``ranks[k]``: row indices for rank ``k`` — its mini-batches in order (``minibatches_per_rank`` consecutive chunks
    of equal size), siblings adjacent inside each chunk. ``costs[k]``: deduplicated token cost of rank ``k``.
    ``split_groups``: groups spread over more than one rank. ``minibatch_split_groups``: groups spread over more
    than one (rank, mini-batch) slot (counts ``split_groups`` too; equal to it when ``minibatches_per_rank == 1``).
    ``split_rows[k]``: rows of rank ``k`` whose group is split across ranks. ``relabelled_groups``: input labels
    whose rows had different prompt lengths and were therefore treated as several groups.
    """

    ranks: list[list[int]]
    costs: list[int]
    split_groups: int
    minibatch_split_groups: int = 0
    minibatches_per_rank: int = 1
    split_rows: list[int] = field(default_factory=list)
    relabelled_groups: int = 0

    def permutation(self) -> list[int]:
        """Global reorder index: rank 0's rows, then rank 1's, ... (what verl's ``batch.reorder`` expects)."""
        return [b for rows in self.ranks for b in rows]


def _prompt_identity_groups(g: list[int], p: list[int]) -> tuple[list[int], int]:
    """Relabel rows by ``(label, prompt_len)``: rows of one label with different prompt lengths cannot share a
    prompt (e.g. the turns of a multi-turn trajectory stored under one uid). Returns the labels and how many input
    labels were split this way."""
    ids: dict[tuple[int, int], int] = {}
    lens: dict[int, set] = {}
    out = []
    for gid, pl in zip(g, p):
        out.append(ids.setdefault((gid, pl), len(ids)))
        lens.setdefault(gid, set()).add(pl)
    return out, sum(1 for s in lens.values() if len(s) > 1)


def _pack(units: list[GroupUnit], cap: list[int], r: list[int]) -> list[list[int]]:
    """Place ``units`` into ``len(cap)`` bins of at most ``cap[k]`` rows, balancing deduplicated cost: largest cost
    first onto the least-loaded bin with room for the whole unit; units that fit nowhere whole are then cut into as
    few pieces as possible, filling the bins with the most free rows first (each piece pays the prompt). A cut is
    kept only when no whole-unit placement has a busiest bin as cheap (:func:`~.placement.best_whole_placement`)."""
    n = len(cap)
    bins: list[list[int]] = [[] for _ in range(n)]
    loads = [0] * n
    deferred: list[GroupUnit] = []
    for u in sorted(units, key=lambda u: (-u.cost, -len(u.rows), u.rows[0])):
        fits = [k for k in range(n) if cap[k] - len(bins[k]) >= len(u.rows)]
        if not fits:
            deferred.append(u)
            continue
        k = min(fits, key=lambda k: (loads[k], k))
        bins[k].extend(u.rows)
        loads[k] += u.cost
    if not deferred:
        return bins
    for u in deferred:
        rows = list(u.rows)
        while rows:
            k = max(range(n), key=lambda k: (cap[k] - len(bins[k]), -loads[k], -k))
            free = cap[k] - len(bins[k])
            assert free > 0, "row capacities sum to the number of rows"
            piece, rows = rows[:free], rows[free:]
            bins[k].extend(piece)
            loads[k] += u.prompt_len + sum(r[b] for b in piece)
    whole = best_whole_placement([len(u.rows) for u in units], [u.cost for u in units], cap, max(loads))
    if whole is None:
        return bins
    bins = [[] for _ in range(n)]
    for u, k in zip(units, whole):
        bins[k].extend(u.rows)
    return bins


def balance_groups_across_ranks(row_group: IntSeq, prompt_lens: IntSeq, response_lens: IntSeq, world_size: int,
                                equal_size: bool = True, minibatches_per_rank: int = 1) -> DPBalance:
    """Bin-pack whole groups onto ``world_size`` ranks (and onto ``minibatches_per_rank`` mini-batches per rank),
    balancing deduplicated token cost.

    Args:
        row_group: ``[B]`` group labels; rows of one label with different ``prompt_lens`` are treated as different
            groups (counted in ``relabelled_groups``), so this never raises on inconsistent labels.
        prompt_lens, response_lens: ``[B]`` valid token counts.
        world_size: data-parallel ranks.
        equal_size: verl dispatches equal DP chunks: each rank gets exactly ``B // world_size`` rows (the first
            ``B % world_size`` ranks one more). Without it whole groups are never split and rank sizes may differ.
        minibatches_per_rank: verl's trainer later cuts each rank's rows into this many consecutive mini-batches of
            equal size; each rank's rows come out mini-batch by mini-batch, so whole groups fill
            mini-batches. Needs ``equal_size`` and ``B`` divisible by ``world_size *
            minibatches_per_rank`` when above 1.

    Groups are placed largest-cost first on the least-loaded rank that still has room for the whole group; groups
    that fit nowhere whole (larger than a rank's share, or left over by uneven sizes) are then cut into as few
    pieces as possible, filling the ranks with the most free rows first (``split_groups``). Then, the same way,
    each rank's groups go into its mini-batches; a group that fits no mini-batch whole is cut inside its rank
    (``minibatch_split_groups``), so the forward-only passes, which run a rank's rows at once, still see it once.
    Works for fewer groups than ranks and for ``B < world_size``.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: expected a positive int, got {world_size!r}.")
    m = minibatches_per_rank
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"minibatches_per_rank: expected a positive int, got {m!r}.")
    g, p, r = _inputs(row_group, prompt_lens, response_lens)
    B = len(g)
    if m > 1 and (not equal_size or B % (world_size * m)):
        raise ValueError(f"minibatches_per_rank: {m} mini-batches per rank need equal_size=True and a batch "
                         f"divisible by world_size * minibatches_per_rank = {world_size * m}; got B={B}, "
                         f"equal_size={equal_size}. Pass minibatches_per_rank=1.")
    g, relabelled = _prompt_identity_groups(g, p)
    if equal_size:
        cap = [B // world_size + (1 if k < B % world_size else 0) for k in range(world_size)]
    else:
        cap = [B] * world_size
    ranks = _pack(_units(g, p, r), cap, r)
    # then each rank's rows into its mini-batches: a group that does not fit a mini-batch is cut inside its rank
    # (it still pays its prompt once per rank in the forward-only passes, which run the whole rank at once)
    slots: list[list[int]] = []
    for rows in ranks:
        if m == 1:
            slots.append(rows)
            continue
        sub = _units([g[b] for b in rows], [p[b] for b in rows], [r[b] for b in rows])
        local = _pack(sub, [len(rows) // m] * m, [r[b] for b in rows])
        slots.extend([rows[i] for i in part] for part in local)
    slots = [_siblings_adjacent(rows, g) for rows in slots]
    ranks = [[b for s in range(k * m, (k + 1) * m) for b in slots[s]] for k in range(world_size)]
    rank_owners = _owners(ranks, g)
    slot_owners = _owners(slots, g)
    split = sum(1 for s in rank_owners.values() if len(s) > 1)
    mb_split = sum(1 for s in slot_owners.values() if len(s) > 1)
    split_rows = [sum(1 for b in rows if len(rank_owners[g[b]]) > 1) for rows in ranks]
    costs = [_cost_of(rows, g, p, r) for rows in ranks]
    return DPBalance(ranks, costs, split, mb_split, m, split_rows, relabelled)


def regroup_within_slots(row_group: IntSeq, prompt_lens: IntSeq, response_lens: IntSeq,
                         slot_of_position: Sequence[Hashable], world_size: int) -> DPBalance:
    """Move rows between data-parallel ranks only among positions of one *slot*, so that a group's rows in a slot
    sit on one rank where they fit — without changing which rows any consumer's mini-batch holds.

    The batch is in the trainer's own (stock) order: position ``i`` holds row ``i`` and goes to rank
    ``i // (B // world_size)`` (verl dispatches equal consecutive chunks). ``slot_of_position[i]`` names every
    optimizer step position ``i`` feeds (e.g. ``(mini-batch of epoch 1, mini-batch of epoch 2, ...)`` for the actor,
    and the critic's too): two positions with the same slot are interchangeable for every consumer, so swapping
    their rows leaves each mini-batch's global set of rows — and hence every loss normaliser and optimizer step —
    unchanged. Within each slot the rows' groups are packed onto the ranks' positions of that slot like
    :func:`balance_groups_across_ranks` packs ranks (whole groups, balanced deduplicated cost, a group cut only
    when it fits nowhere whole); a rank's rows of a slot fill its positions of that slot in ascending order,
    siblings adjacent.

    Args:
        row_group, prompt_lens, response_lens: ``[B]`` as in :func:`balance_groups_across_ranks`.
        slot_of_position: ``[B]`` hashable slot names.
        world_size: data-parallel ranks; must divide ``B``.

    Returns:
        :class:`DPBalance` with ``ranks[k]`` = the rows (indices into the input order) rank ``k`` gets, in
        position order; ``split_groups`` counts groups on more than one rank, ``minibatch_split_groups`` groups on
        more than one (rank, slot) pair, and ``minibatches_per_rank`` the number of distinct slots.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: expected a positive int, got {world_size!r}.")
    g, p, r = _inputs(row_group, prompt_lens, response_lens)
    B = len(g)
    if len(slot_of_position) != B:
        raise ValueError(f"slot_of_position: expected one slot per row [B={B}], got {len(slot_of_position)}.")
    if B % world_size:
        raise ValueError(f"world_size: the batch ({B} rows) must split into equal chunks over {world_size} ranks, "
                         "as verl dispatches it.")
    g, relabelled = _prompt_identity_groups(g, p)
    chunk = B // world_size
    positions: dict[Hashable, list[int]] = {}
    for i, s in enumerate(slot_of_position):
        positions.setdefault(s, []).append(i)
    order: list[int] = [-1] * B  # position -> row
    home: dict[int, dict[int, int]] = {}  # group -> {rank: rows placed there}
    slot_parts: list[list[int]] = []
    for pos in positions.values():  # slots in order of first position
        mine = [[] for _ in range(world_size)]  # each rank's positions of this slot, ascending
        for i in pos:
            mine[i // chunk].append(i)
        cap = [len(m) for m in mine]
        # the slot's rows are exactly the rows at its positions; pack them with local indices 0..len(pos)-1
        lg, lp, lr = [g[i] for i in pos], [p[i] for i in pos], [r[i] for i in pos]
        units = _units(lg, lp, lr)
        # a group already placed on a rank (earlier slots) goes back there when it fits whole: the forward-only
        # passes run a rank's rows at once, and other consumers' steps may cut one actor step into several slots
        homed: list[list[int]] = [[] for _ in range(world_size)]
        rest = []
        for u in sorted(units, key=lambda u: (-len(u.rows), -u.cost, u.rows[0])):
            ks = [k for k in home.get(u.group, ()) if cap[k] - len(homed[k]) >= len(u.rows)]
            if ks:
                homed[max(ks, key=lambda k: (home[u.group][k], -k))].extend(u.rows)
            else:
                rest.append(u)
        bins = _pack(rest, [cap[k] - len(homed[k]) for k in range(world_size)], lr)
        by_rank = [_siblings_adjacent([pos[j] for j in homed[k] + bins[k]], g) for k in range(world_size)]
        for k in range(world_size):
            for i in by_rank[k]:
                home.setdefault(g[i], {}).setdefault(k, 0)
                home[g[i]][k] += 1
        for k in range(world_size):
            assert len(mine[k]) == len(by_rank[k]), "packing respects the per-rank capacity of the slot"
            for i, row in zip(mine[k], by_rank[k]):
                order[i] = row
            slot_parts.append(by_rank[k])
    ranks = [order[k * chunk:(k + 1) * chunk] for k in range(world_size)]
    rank_owners = _owners(ranks, g)
    slot_owners = _owners(slot_parts, g)
    split_rows = [sum(1 for b in rows if len(rank_owners[g[b]]) > 1) for rows in ranks]
    return DPBalance(ranks, [_cost_of(rows, g, p, r) for rows in ranks],
                     sum(1 for s in rank_owners.values() if len(s) > 1),
                     sum(1 for s in slot_owners.values() if len(s) > 1), len(positions), split_rows, relabelled)


def _owners(parts: list[list[int]], g: list[int]) -> dict[int, set]:
    owners: dict[int, set] = {}
    for k, rows in enumerate(parts):
        for b in rows:
            owners.setdefault(g[b], set()).add(k)
    return owners


def _siblings_adjacent(rows: list[int], g: list[int]) -> list[int]:
    """Sort ``rows`` by (first row of their group, row): ascending, with siblings adjacent."""
    first: dict[int, int] = {}
    for b in rows:
        first[g[b]] = min(first.get(g[b], b), b)
    return sorted(rows, key=lambda b: (first[g[b]], b))
