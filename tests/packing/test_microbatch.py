"""Group-aware micro-batching and DP balancing (torch only)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zorro_verl.packing.microbatch import (
    balance_groups_across_ranks,
    dynamic_microbatches,
    fixed_size_microbatches,
    microbatch_cost,
    restore_permutation,
    split_to_count,
)

# ----------------------------------------------------------------------------------------- hand-written cases
# Interleaved groups: rows 0,2,4 = group 7 (prompt 10), rows 1,3 = group 5 (prompt 4), row 5 = group 9 (prompt 6).
G = [7, 5, 7, 5, 7, 9]
P = [10, 4, 10, 4, 10, 6]
R = [3, 2, 1, 5, 0, 4]


def test_fixed_size_keeps_groups_whole():
    mbs = fixed_size_microbatches(G, P, R, micro_batch_size=3)
    # group 7 (3 rows) fills mb0; group 5 (2 rows) opens mb1; group 9 (1 row) fits in mb1.
    assert mbs.batches == [[0, 2, 4], [1, 3, 5]]
    assert mbs.split_groups == 0
    assert mbs.costs == [10 + 3 + 1 + 0, 4 + 2 + 5 + 6 + 4]
    assert mbs.ordinary_tokens == sum(P) + sum(R)
    assert mbs.dedup_tokens == sum(mbs.costs)


def test_fixed_size_splits_large_group_and_counts_it():
    mbs = fixed_size_microbatches(G, P, R, micro_batch_size=2)
    # group 7 -> [0, 2] full chunk, remainder [4] placed like a group; group 5 -> [1, 3]; group 9 joins [4].
    assert mbs.batches == [[0, 2], [4, 5], [1, 3]]
    assert mbs.split_groups == 1


def test_dynamic_counts_prompt_once():
    # group 7 costs 10+4=14, group 5 costs 4+7=11, group 9 costs 10. Ordinary cost of group 7 would be 34.
    mbs = dynamic_microbatches(G, P, R, max_token_len=25)
    # FFD: 14 -> bin0; 11 -> bin0 (25); 10 -> bin1.
    assert mbs.batches == [[0, 1, 2, 3, 4], [5]]
    assert mbs.costs == [25, 10]
    assert mbs.split_groups == 0


def test_dynamic_splits_group_over_budget():
    mbs = dynamic_microbatches([0, 0, 0], [10, 10, 10], [5, 5, 5], max_token_len=21)
    # prompt 10 + 5 + 5 = 20 fits, the third response needs its own prompt copy.
    assert mbs.batches == [[0, 1], [2]]
    assert mbs.costs == [20, 15]
    assert mbs.split_groups == 1


def test_dynamic_row_over_budget_raises():
    with pytest.raises(ValueError, match="max_token_len"):
        dynamic_microbatches([0], [10], [5], max_token_len=14)


def test_dynamic_min_count_reaches_count():
    mbs = dynamic_microbatches(G, P, R, max_token_len=1000, min_num_micro_batches=3)
    assert len(mbs) == 3
    assert sorted(b for mb in mbs.batches for b in mb) == list(range(6))


def test_split_to_count_errors():
    mbs = fixed_size_microbatches([0, 0], [1, 1], [1, 1], 2)
    with pytest.raises(ValueError, match="only 2 rows"):
        split_to_count(mbs, 3, [0, 0], [1, 1], [1, 1])
    with pytest.raises(ValueError, match="current"):
        split_to_count(fixed_size_microbatches([0, 1], [1, 1], [1, 1], 1), 1, [0, 1], [1, 1], [1, 1])


def test_restore_permutation():
    batches = [[2, 0], [3], [1]]
    perm = restore_permutation(batches)
    outputs = torch.tensor([20, 0, 30, 10])  # per-row values in micro-batch order
    assert outputs[perm].tolist() == [0, 10, 20, 30]
    with pytest.raises(ValueError):
        restore_permutation([[0], [0]])


def test_api_soft_budget_keeps_oversized_groups_whole():
    # group 7 costs 10 + 4 = 14 > 12: with split_oversized_groups=False it forms its own micro-batch, whole
    mbs = dynamic_microbatches(G, P, R, 12, split_oversized_groups=False)
    assert [0, 2, 4] in mbs.batches and mbs.split_groups == 0
    assert sorted(b for mb in mbs.batches for b in mb) == list(range(6))


def test_prompt_len_mismatch_in_group_raises():
    with pytest.raises(ValueError, match="share group"):
        fixed_size_microbatches([0, 0], [3, 4], [1, 1], 2)


def test_balance_whole_groups_equal_size():
    # 4 groups of 2 rows, 2 ranks of 4 rows: all whole; costs: g0 = 10+2, g1 = 10+2, g2 = 2+2, g3 = 2+2.
    g = [0, 1, 2, 3, 0, 1, 2, 3]
    p = [10, 10, 2, 2, 10, 10, 2, 2]
    r = [1] * 8
    bal = balance_groups_across_ranks(g, p, r, world_size=2)
    assert bal.split_groups == 0
    assert sorted(len(x) for x in bal.ranks) == [4, 4]
    assert sorted(bal.costs) == [16, 16]  # one big and one small group each
    assert sorted(bal.permutation()) == list(range(8))
    for rows in bal.ranks:  # siblings adjacent
        gs = [g[b] for b in rows]
        assert gs[0] == gs[1] and gs[2] == gs[3]


def test_balance_group_larger_than_share():
    bal = balance_groups_across_ranks([0] * 8, [5] * 8, [1] * 8, world_size=4)
    assert [len(x) for x in bal.ranks] == [2, 2, 2, 2]
    assert bal.split_groups == 1
    assert bal.costs == [7, 7, 7, 7]


def test_balance_fewer_rows_than_ranks():
    bal = balance_groups_across_ranks([0, 0, 1], [2, 2, 3], [1, 1, 1], world_size=4)
    assert sorted(len(x) for x in bal.ranks) == [0, 1, 1, 1]
    assert sorted(b for x in bal.ranks for b in x) == [0, 1, 2]


def test_balance_uneven_groups():
    # sizes 3, 3, 2 onto 2 ranks of 4: one 3-group cannot stay whole with the others; exactly one split.
    g = [0, 0, 0, 1, 1, 1, 2, 2]
    bal = balance_groups_across_ranks(g, [4] * 8, [1] * 8, world_size=2)
    assert [len(x) for x in bal.ranks] == [4, 4]
    assert bal.split_groups == 1


# ----------------------------------------------------------------------------------------- properties
@st.composite
def batches(draw, max_rows=24):
    B = draw(st.integers(1, max_rows))
    n_groups = draw(st.integers(1, B))
    g = [draw(st.integers(0, n_groups - 1)) for _ in range(B)]
    plen = {k: draw(st.integers(1, 30)) for k in set(g)}
    p = [plen[k] for k in g]
    r = [draw(st.integers(0, 20)) for _ in range(B)]
    return g, p, r


def _is_partition(batches_, B):
    flat = [b for mb in batches_ for b in mb]
    return sorted(flat) == list(range(B)) and all(mb for mb in batches_)


def _groups_split(batches_, g):
    owners = {}
    for i, mb in enumerate(batches_):
        for b in mb:
            owners.setdefault(g[b], set()).add(i)
    return {k for k, s in owners.items() if len(s) > 1}


@settings(max_examples=150, deadline=None)
@given(batches(), st.integers(1, 10))
def test_fixed_size_properties(data, mbs_size):
    g, p, r = data
    mbs = fixed_size_microbatches(g, p, r, mbs_size)
    assert _is_partition(mbs.batches, len(g))
    assert all(len(mb) <= mbs_size for mb in mbs.batches)
    split = _groups_split(mbs.batches, g)
    assert mbs.split_groups == len(split)
    # only groups larger than the micro-batch size are ever split
    assert all(g.count(k) > mbs_size for k in split)
    assert mbs.costs == [microbatch_cost(mb, g, p, r) for mb in mbs.batches]
    perm = restore_permutation(mbs.batches)
    assert torch.tensor([b for mb in mbs.batches for b in mb])[perm].tolist() == list(range(len(g)))


@settings(max_examples=150, deadline=None)
@given(batches(), st.integers(0, 60), st.integers(1, 6))
def test_dynamic_properties(data, extra, min_count):
    g, p, r = data
    budget = max(pi + ri for pi, ri in zip(p, r)) + extra
    min_count = min(min_count, len(g))
    mbs = dynamic_microbatches(g, p, r, budget, min_num_micro_batches=min_count)
    assert _is_partition(mbs.batches, len(g))
    assert len(mbs) >= min_count
    assert all(c <= budget for c in mbs.costs)
    assert mbs.costs == [microbatch_cost(mb, g, p, r) for mb in mbs.batches]
    if min_count == 1:
        # a group is split only when it does not fit the budget whole
        for k in _groups_split(mbs.batches, g):
            rows = [b for b in range(len(g)) if g[b] == k]
            assert microbatch_cost(rows, g, p, r) > budget


@settings(max_examples=100, deadline=None)
@given(batches(), st.integers(1, 8))
def test_split_to_count_properties(data, target):
    g, p, r = data
    target = min(target, len(g))
    base = fixed_size_microbatches(g, p, r, len(g))  # one micro-batch holding everything
    out = split_to_count(base, max(target, len(base)), g, p, r)
    assert len(out) == max(target, len(base))
    assert _is_partition(out.batches, len(g))


@settings(max_examples=150, deadline=None)
@given(batches(max_rows=32), st.integers(1, 8))
def test_balance_properties(data, world):
    g, p, r = data
    B = len(g)
    bal = balance_groups_across_ranks(g, p, r, world)
    assert sorted(bal.permutation()) == list(range(B))
    assert sorted(len(x) for x in bal.ranks) == sorted(B // world + (1 if k < B % world else 0) for k in range(world))
    split = _groups_split([x for x in bal.ranks if x], g)
    assert bal.split_groups == len(split)
    share = -(-B // world)
    # uniform group sizes that divide the share never split
    sizes = {g.count(k) for k in set(g)}
    if len(sizes) == 1 and B % world == 0 and (B // world) % sizes.pop() == 0:
        assert bal.split_groups == 0
    assert all(len(x) <= share for x in bal.ranks)
    no_equal = balance_groups_across_ranks(g, p, r, world, equal_size=False)
    assert no_equal.split_groups == 0
    assert sorted(no_equal.permutation()) == list(range(B))


# ------------------------------------------------------------------------- prompt identity and mini-batch slots
def test_balance_label_with_different_prompt_lengths_never_raises():
    # Multi-turn: rows 0-3 carry one uid; rows 0,1 share the first prompt (len 5), rows 2,3 are later turns with
    # the accumulated conversation as prompt (len 9 and 12). They are three groups, not an error.
    g = [0, 0, 0, 0, 1, 1, 1, 1]
    p = [5, 5, 9, 12, 7, 7, 7, 7]
    bal = balance_groups_across_ranks(g, p, [2] * 8, world_size=2)
    assert sorted(bal.permutation()) == list(range(8))
    assert bal.relabelled_groups == 1
    assert bal.costs == [microbatch_cost(rows, [0, 0, 1, 2, 3, 3, 3, 3], p, [2] * 8) for rows in bal.ranks]


def test_balance_minibatch_slots_keep_groups_whole():
    # 4 groups of 2 rows, 2 ranks x 2 mini-batches of 2 rows: each slot holds one whole group.
    g = [0, 1, 2, 3, 0, 1, 2, 3]
    bal = balance_groups_across_ranks(g, [6, 5, 4, 3] * 2, [1] * 8, world_size=2, minibatches_per_rank=2)
    assert [len(x) for x in bal.ranks] == [4, 4]
    assert bal.split_groups == 0 and bal.minibatch_split_groups == 0
    for rows in bal.ranks:
        for mb in (rows[:2], rows[2:]):
            assert len({g[b] for b in mb}) == 1
    # one slot per rank (the default) puts two groups in a rank's row block in any order: no mini-batch guarantee
    assert balance_groups_across_ranks(g, [6, 5, 4, 3] * 2, [1] * 8, world_size=2).minibatches_per_rank == 1


def test_balance_minibatch_slots_reject_indivisible_batch():
    with pytest.raises(ValueError, match="minibatches_per_rank"):
        balance_groups_across_ranks([0] * 6, [1] * 6, [1] * 6, world_size=2, minibatches_per_rank=2)


@settings(max_examples=150, deadline=None)
@given(batches(max_rows=32), st.integers(1, 4), st.integers(1, 4))
def test_balance_minibatch_slot_properties(data, world, m):
    g, p, r = data
    B = len(g) - len(g) % (world * m)
    if B == 0:
        return
    g, p, r = g[:B], p[:B], r[:B]
    bal = balance_groups_across_ranks(g, p, r, world, minibatches_per_rank=m)
    assert sorted(bal.permutation()) == list(range(B))
    per_rank, per_slot = B // world, B // (world * m)
    assert all(len(x) == per_rank for x in bal.ranks)
    slots = [rows[j * per_slot:(j + 1) * per_slot] for rows in bal.ranks for j in range(m)]
    assert bal.minibatch_split_groups == len(_groups_split(slots, g))
    assert bal.split_groups == len(_groups_split(bal.ranks, g))
    # mini-batch slots never cost rank-level deduplication: the same rows per rank as without them
    assert [sorted(x) for x in bal.ranks] == [sorted(x) for x in balance_groups_across_ranks(g, p, r, world).ranks]
    split = _groups_split(bal.ranks, g)
    assert bal.split_rows == [sum(1 for b in rows if g[b] in split) for rows in bal.ranks]
    sizes = {g.count(k) for k in set(g)}
    if len(sizes) == 1 and per_slot % sizes.pop() == 0:  # uniform groups that divide a slot never split
        assert bal.minibatch_split_groups == 0


@settings(max_examples=100, deadline=None)
@given(batches(max_rows=24), st.integers(1, 4))
def test_balance_never_raises_on_mixed_prompt_lengths(data, world):
    g, p, r = data
    p = [v + (b % 3) for b, v in enumerate(p)]  # the same label may now carry several prompt lengths
    bal = balance_groups_across_ranks(g, p, r, world)
    assert sorted(bal.permutation()) == list(range(len(g)))
