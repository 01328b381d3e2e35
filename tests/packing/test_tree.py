"""The prefix-tree plan: hand-written trie, properties over random tries, the min-shared-length rule, validation."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zorro_verl.packing import build_plan
from zorro_verl.testing import batch_from_rows, dense_mask


@st.composite
def tree_rows(draw, vocab=4):
    """Rows ``(prompt, response)`` drawn as prefixes of a few random base sequences plus random tails: branch
    points inside prompts and inside responses, rows that are prefixes of other rows, identical rows, empty
    responses, any row order. Returns ``(rows, response_masks, min_shared_len)``."""
    bases = [[draw(st.integers(1, vocab)) for _ in range(draw(st.integers(1, 12)))]
             for _ in range(draw(st.integers(1, 3)))]
    rows, masks = [], []
    for _ in range(draw(st.integers(1, 7))):
        base = draw(st.sampled_from(bases))
        seq = base[:draw(st.integers(0, len(base)))] + [draw(st.integers(1, vocab))
                                                        for _ in range(draw(st.integers(0, 4)))]
        seq = seq or [1]
        p = draw(st.integers(1, len(seq)))
        rows.append((seq[:p], seq[p:]))
        masks.append([draw(st.integers(0, 1)) for _ in seq[p:]])
    return rows, masks, draw(st.integers(1, 4))


def _plan(rows, min_shared=1, **kw):
    b = batch_from_rows(rows)
    return b, build_plan(b["input_ids"], b["attention_mask"], b["responses"].shape[1], sharing="prefix",
                         min_shared_len=min_shared, **kw)


def test_hand_written_trie():
    #  rows: 0: [7 7 7 1 1 | 2 2]  1: [7 7 7 1 1 | 3]  2: [7 7 7 4 | 5 5]  3: [7 7 7 1 1 | 2 2 9]  4 = row 0
    rows = [([7, 7, 7, 1, 1], [2, 2]), ([7, 7, 7, 1, 1], [3]), ([7, 7, 7, 4], [5, 5]), ([7, 7, 7, 1, 1], [2, 2, 9]),
            ([7, 7, 7, 1, 1], [2, 2])]
    _, p = _plan(rows, min_shared=2)
    t = p.tree
    # nodes (DFS): n0=[7 7 7] -> n1=[1 1] -> n2=[2 2 9] (row 0 ends inside it: rows need no node boundary);
    # n1 -> n3=[3];  n0 -> n4=[4 5 5]
    assert p.input_ids.tolist() == [7, 7, 7, 1, 1, 2, 2, 9, 3, 4, 5, 5]
    assert p.position_ids.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 5, 3, 4, 5]
    assert t.node_start.tolist() == [0, 3, 5, 8, 9] and t.node_len.tolist() == [3, 2, 3, 1, 3]
    assert t.node_parent.tolist() == [-1, 0, 1, 1, 0] and t.node_pos0.tolist() == [0, 3, 5, 5, 3]
    assert t.node_sub_end.tolist() == [12, 9, 8, 9, 12] and t.levels == 3
    assert t.row_node.tolist() == [2, 3, 4, 2, 2]  # rows 0 and 4 are identical; row 0 is a prefix of row 3
    assert p.logit_index.tolist() == [4, 5, 4, 9, 10, 4, 5, 6, 4, 5]
    assert p.target_ids.tolist() == [2, 2, 3, 5, 5, 2, 2, 9, 2, 2]
    assert p.head_index.tolist() == [4, 5, 6, 9, 10]  # 10 outputs, 5 distinct predicting positions
    assert p.head_index[p.head_inverse].tolist() == p.logit_index.tolist()
    assert (p.G, p.T, p.N, p.ordinary_tokens) == (1, 12, 10, 7 + 6 + 6 + 8 + 7)
    # min_shared_len 3: [2 2] (2 tokens) is not kept, its children recompute it; [1 1] stays: it completes a
    # prompt shared by identical prompts
    _, p3 = _plan(rows, min_shared=3)
    assert p3.input_ids.tolist() == [7, 7, 7, 1, 1, 2, 2, 2, 2, 9, 3, 4, 5, 5]
    # with different prompts, the short [1 1] would fragment: it is recomputed per child
    rows2 = [([7, 7, 7, 1, 1, 2], [2]), ([7, 7, 7, 1, 1, 3], [3]), ([7, 7, 7, 4], [5])]
    _, p4 = _plan(rows2, min_shared=3)
    assert p4.input_ids.tolist() == [7, 7, 7, 1, 1, 2, 2, 1, 1, 3, 3, 4, 5]


@settings(max_examples=60, deadline=None)
@given(tree_rows())
def test_tree_plan_properties(case):
    rows, _, min_shared = case
    b, p = _plan(rows, min_shared)
    ids, am = b["input_ids"], b["attention_mask"]
    # each row's valid tokens and positions are read back exactly through full_index
    fi = p.full_index()
    assert ((fi >= 0) == am.bool()).all()
    assert (p.input_ids[fi.clamp(min=0)] == ids)[am.bool()].all()
    assert (p.position_ids[fi.clamp(min=0)] == b["position_ids"])[am.bool()].all()
    # the logit of each response token sits one position before it on the row's path
    R = b["responses"].shape[1]
    Pw = ids.shape[1] - R
    assert (p.logit_index == fi[p.out_row, Pw + p.out_col - 1]).all()
    assert (p.target_ids == ids[p.out_row, Pw + p.out_col]).all()
    # sharing never computes more than the ordinary rows, and the dense mask's rows are the rows' prefixes
    assert p.T <= p.ordinary_tokens
    m = dense_mask(p)
    for r in range(p.B):
        toks = fi[r][fi[r] >= 0]
        last = toks[-1]
        assert set(torch.nonzero(m[last])[:, 0].tolist()) == set(toks.tolist())
    # identical prompts are always shared, however short (the prompt plan's grouping is kept)
    pp = build_plan(ids, am, R)
    assert p.T <= pp.T


def test_depth_one_when_only_prompts_are_shared():
    # GRPO: 2 prompts x 3 responses that share nothing: the tree is prompt -> responses, the prompt plan's layout
    rows = [([1, 2, 3], [4, 5]), ([1, 2, 3], [6]), ([1, 2, 3], [7, 8, 9]), ([5, 5], [1]), ([5, 5], [2, 2]),
            ([5, 5], [3])]
    b, p = _plan(rows, min_shared=64)
    pp = build_plan(b["input_ids"], b["attention_mask"], b["responses"].shape[1])
    assert p.tree.levels == 2 and p.G == pp.G == 2 and p.T == pp.T and p.N == pp.N
    assert sorted(p.tree.node_len.tolist()) == sorted(pp.prompt_lens.tolist() + pp.response_lens.tolist())


def test_bad_sharing_arguments():
    ids = torch.ones(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="sharing: expected one of"):
        build_plan(ids, None, 1, sharing="tree")
    with pytest.raises(ValueError, match="min_shared_len: expected an int >= 1"):
        build_plan(ids, None, 1, sharing="prefix", min_shared_len=0)
    with pytest.raises(TypeError, match="min_shared_len"):
        build_plan(ids, None, 1, sharing="prefix", min_shared_len=2.0)
    with pytest.raises(ValueError, match="only used with sharing='prefix'"):
        build_plan(ids, None, 1, min_shared_len=4)
    with pytest.raises(ValueError, match="left padded"):  # the layout checks of the prompt plan apply
        build_plan(ids, torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]]), 1, sharing="prefix")


def test_prompt_plan_layouts_refuse_tree_plans():
    _, p = _plan([([1, 2], [3]), ([1, 2], [4])])
    for name in ("token_layout", "nonempty_rows", "response_positions"):
        with pytest.raises(ValueError, match="prefix tree"):
            getattr(p, name)()


@settings(max_examples=40, deadline=None)
@given(tree_rows(), st.integers(0, 12))
def test_dynamic_budget_on_tree_costs(case, extra):
    """``tree_row_costs`` units in ``dynamic_microbatches``: every micro-batch's tree plan runs at most its reported
    cost, which is within the budget; a micro-batch of whole clusters costs exactly its plan's ``T``."""
    from zorro_verl.packing.microbatch import dynamic_microbatches
    from zorro_verl.packing.tree import tree_row_costs

    rows, _, min_shared = case
    b = batch_from_rows(rows)
    ids, am, R = b["input_ids"], b["attention_mask"], b["responses"].shape[1]
    tc = tree_row_costs(ids, am, R, min_shared)
    budget = max(tc["length"]) + extra  # every row fits alone
    mbs = dynamic_microbatches(tc["cluster"], tc["root_len"], tc["own"], budget, split_response_lens=tc["below_root"])
    assert sorted(x for mb in mbs.batches for x in mb) == list(range(len(rows)))
    owners = {}
    for i, mb in enumerate(mbs.batches):
        for x in mb:
            owners.setdefault(tc["cluster"][x], set()).add(i)
    for mb, cost in zip(mbs.batches, mbs.costs):
        idx = torch.tensor(mb)
        T = build_plan(ids[idx], am[idx], R, sharing="prefix", min_shared_len=min_shared).T
        assert T <= cost <= budget
        if all(len(owners[tc["cluster"][x]]) == 1 for x in mb):
            assert cost == T


def _block_cost(lens, ancs, part, call):
    return sum(len(b) * max(lens[j] for j in b) * (max(ancs[j] for j in b) + max(lens[j] for j in b)) + call
               for b in part)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 12), st.integers(1, 30)), min_size=1, max_size=9), st.integers(0, 400))
def test_child_buckets_is_the_best_split_of_the_sorted_nodes(nodes, call):
    """The dense backends' blocks of non-root nodes: every node in exactly one block, each block's (count, longest
    node, longest chain) true, and the cost (padded pairs + ``call`` per block) the minimum over every split of the
    length-sorted nodes into at most 4 runs, found by brute force."""
    import itertools

    from zorro_verl.packing.tree import child_buckets

    lens, ancs = [n[0] for n in nodes], [n[1] for n in nodes]
    order, buckets = child_buckets(lens, ancs, call_pairs=call)
    assert sorted(order) == list(range(len(lens))) and sum(b[0] for b in buckets) == len(lens)
    assert 1 <= len(buckets) <= 4
    part, off = [], 0
    for n, lq, a in buckets:
        blk = order[off:off + n]
        off += n
        assert lq == max(lens[j] for j in blk) and a == max(ancs[j] for j in blk)
        part.append(blk)
    srt = sorted(range(len(lens)), key=lambda j: (lens[j], ancs[j]))
    cut_ok = [i for i in range(1, len(srt)) if lens[srt[i]] != lens[srt[i - 1]]]  # cuts between equal lengths
    best = min(_block_cost(lens, ancs, [srt[a:b] for a, b in zip((0,) + cs, cs + (len(srt),))], call)
               for k in range(4) for cs in itertools.combinations(cut_ok, k))
    assert _block_cost(lens, ancs, part, call) == best


def test_child_buckets_separates_short_questions_from_long_responses():
    """The shape of a GRPO batch behind a shared system prompt: short question nodes under the system prompt, long
    responses under each question. One block would pad every question to a response's length."""
    from zorro_verl.packing.tree import child_buckets

    lens, ancs = [30] * 8 + [64] * 64, [320] * 8 + [350] * 64
    order, buckets = child_buckets(lens, ancs)
    assert buckets == ((8, 30, 320), (64, 64, 350)) and sorted(order[:8]) == list(range(8))
    assert child_buckets([], []) == ([], ())
