"""Whole-unit placement search for data-parallel balancing (docs/design/packing.md). Pure Python, no torch.

The balancer's greedy packing (largest cost first onto the least-loaded bin with room) can leave a group that fits
nowhere whole and must be cut, although another order keeps every group whole with a busiest bin no more expensive.
Example, two ranks of 3 rows: groups X (2 rows, cost 12), Y (1 row, 11), Z (1 row, 10), W (2 rows, prompt 3 +
responses 3 + 3); greedy puts X on rank 0, Y and Z on rank 1, and W must be cut (busiest rank 27, W's prompt paid
twice), while {X, Z} / {Y, W} keeps everything whole (busiest 22). :func:`best_whole_placement` searches the
whole-unit placements for one whose busiest bin is no worse than a bound, so the balancer cuts a group only when no
such placement exists (exactly so on small instances: the search is exhaustive within its node budget).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

__all__ = ["best_whole_placement", "SEARCH_NODE_BUDGET"]

#: Search nodes visited at most per call (a depth-first branch and bound; each node is one unit tried on one bin).
#: Instances of a few dozen units finish well inside it; larger ones return the best placement found so far.
SEARCH_NODE_BUDGET = 200_000


def best_whole_placement(sizes: Sequence[int], costs: Sequence[int], cap: Sequence[int], bound: int,
                         node_budget: int = SEARCH_NODE_BUDGET) -> Optional[list[int]]:
    """The bin of every unit in a placement that keeps each unit whole, respects the row capacities and minimises
    the busiest bin's cost, among placements whose busiest bin costs at most ``bound``.

    Args:
        sizes: ``[U]`` rows of each unit (a prompt group); ``costs``: ``[U]`` its deduplicated token cost.
        cap: ``[K]`` rows each bin (rank, or (rank, mini-batch) slot) takes; ``sum(cap) >= sum(sizes)``.
        bound: the busiest-bin cost to match or beat (e.g. that of a placement that cuts a group).
        node_budget: search nodes at most; when it runs out the best placement found so far is returned.

    Returns:
        ``[U]`` bin indices, or ``None`` when no whole placement within ``bound`` was found.
    """
    n_units, n_bins = len(sizes), len(cap)
    if n_units == 0:
        return []
    # big units first (capacity is the hard constraint), then expensive ones (the balance)
    order = sorted(range(n_units), key=lambda i: (-sizes[i], -costs[i], i))
    suffix_cost = [0] * (n_units + 1)
    for j in range(n_units - 1, -1, -1):
        suffix_cost[j] = suffix_cost[j + 1] + costs[order[j]]
    loads = [0] * n_bins
    free = list(cap)
    assign = [-1] * n_units
    best: list = [bound, None]  # inclusive limit on the busiest bin, best assignment
    nodes = [0]

    def dfs(j: int, busiest: int) -> None:
        if j == n_units:
            best[0], best[1] = busiest - 1, list(assign)  # from now on only strictly better placements
            return
        # the remaining cost spread perfectly over the bins: a lower bound on the busiest bin
        if max(busiest, -(-(sum(loads) + suffix_cost[j]) // n_bins)) > best[0]:
            return
        i = order[j]
        tried: set = set()
        for k in sorted(range(n_bins), key=lambda k: (loads[k], k)):
            if free[k] < sizes[i] or loads[k] + costs[i] > best[0] or (loads[k], free[k]) in tried:
                continue
            tried.add((loads[k], free[k]))  # bins in the same state are interchangeable
            nodes[0] += 1
            if nodes[0] > node_budget:
                return
            loads[k] += costs[i]
            free[k] -= sizes[i]
            assign[i] = k
            dfs(j + 1, max(busiest, loads[k]))
            loads[k] -= costs[i]
            free[k] += sizes[i]
            assign[i] = -1

    dfs(0, 0)
    return best[1]
