"""Every backend on prefix-tree plans vs the dense-mask oracle (fp64): outputs and q/k/v gradients over random
tries; the flash backends through the plain-torch varlen primitives (the copy-free path merges k + 1 partial
results per token by log-sum-exp); flex forward on CPU."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.attention.test_backends import _qkv
from tests.attention.test_features import BACKENDS as FEATURE_BACKENDS
from tests.attention.test_features import _check as check_features
from tests.packing.test_tree import tree_rows
from zorro_verl.attention import attend
from zorro_verl.attention.copyfree import attend_copyfree, copyfree_index
from zorro_verl.attention.primitives import torch_primitives
from zorro_verl.attention.varlen import attend_varlen
from zorro_verl.packing import build_plan
from zorro_verl.testing import batch_from_rows, dense_attention_oracle, multi_turn_rows

TOL = 1e-12  # fp64: the same math up to summation order
PRIMS = torch_primitives()
VARIANTS = {
    "sdpa": lambda plan, *a: attend(plan, "sdpa", *a),
    "eager": lambda plan, *a: attend(plan, "eager", *a),
    "standard": lambda plan, *a: attend(plan, "standard", *a),
    "flash_copyfree": lambda plan, *a: attend_copyfree(plan, *a, prims=PRIMS),
    "flash": lambda plan, *a: attend_varlen(plan, *a, prims=PRIMS),
    "flash_copyfree_cpu": lambda plan, *a: attend(plan, "flash_copyfree", *a),  # its CPU flash kernels
}


def _tree_plan(rows, min_shared=1):
    b = batch_from_rows(rows)
    return build_plan(b["input_ids"], b["attention_mask"], b["responses"].shape[1], sharing="prefix",
                      min_shared_len=min_shared)


def _check_all(plan, hq=4, hkv=2, seed=0):
    q, k, v = _qkv(plan, hq, hkv, seed=seed)
    ref = dense_attention_oracle(plan, q, k, v, 0.3)
    w = torch.randn_like(ref)
    g_ref = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for name, fn in VARIANTS.items():
        out = fn(plan, q, k, v, 0.3)
        assert out.shape == ref.shape, name
        assert (out - ref).abs().max().item() <= TOL, name
        for a, b in zip(torch.autograd.grad((out * w).sum(), (q, k, v)), g_ref):
            assert (a - b).abs().max().item() <= TOL, name
    flex = attend(plan, "flex", q.detach(), k.detach(), v.detach(), 0.3)
    assert (flex - ref).abs().max().item() <= TOL


@settings(max_examples=25, deadline=None)
@given(tree_rows())
def test_backends_over_random_tries(case):
    rows, _, min_shared = case
    _check_all(_tree_plan(rows, min_shared))


def branching_rows(depth=3, width=2, turn=3, seed=0):
    """A tree rollout: from one prompt, every turn branches into ``width`` continuations, each stored as a sample
    (its prompt the path so far, its response the next turn): a trie of ``depth`` + 1 node levels."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda: torch.randint(1, 50, (turn,), generator=g).tolist()  # noqa: E731
    rows, frontier = [], [rnd()]
    for _ in range(depth):
        nxt = []
        for ctx in frontier:
            for _ in range(width):
                t = rnd()
                rows.append((ctx, t))
                nxt.append(ctx + t)
        frontier = nxt
    return rows


@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 1)])
def test_deep_branching_tree(hq, hkv):
    plan = _tree_plan(branching_rows())
    assert plan.tree.levels == 4
    # copy-free: one non-causal call per ancestor level, each key token read by one level only
    ix = copyfree_index(plan)
    assert len(ix["levels"]) == plan.tree.levels - 1
    assert sum(lv[1].numel() for lv in ix["levels"]) <= plan.T
    _check_all(plan, hq, hkv)


def test_multi_turn_samples_are_one_node_per_trajectory():
    rows, _ = multi_turn_rows(4, first_prompt_len=5, turn_len=3, observation_len=2, trajectories=2, vocab_size=50)
    plan = _tree_plan(rows)
    assert plan.tree.M == 2 and plan.tree.levels == 1  # each sample is a prefix of the next: one chain, merged
    _check_all(plan)


def test_single_node_and_no_sharing():
    _check_all(_tree_plan([([3, 4, 5], [6, 7])]))  # one row: one root, no child
    _check_all(_tree_plan([([1, 2], [3]), ([4, 5], [6])]))  # nothing shared: roots only


@settings(max_examples=10, deadline=None)
@given(tree_rows(), st.integers(1, 9), st.booleans(), st.booleans())
def test_tree_with_window_sinks_softcap(case, window, sinks, softcap):
    """Prefix trees with the attention features of sliding-window / sink / soft-capped models: the window is
    measured on each row's positions (a node continues its ancestors' positions), every backend vs the oracle."""
    rows, _, min_shared = case
    plan = _tree_plan(rows, min_shared)
    feat = dict(window=window, sinks=sinks, softcap=0.8 if softcap else None)
    for backend in FEATURE_BACKENDS:
        check_features(plan, backend, feat)


def test_tree_flex_forward_with_window():
    from zorro_verl.attention import AttentionFeatures

    plan = _tree_plan(branching_rows(depth=3, width=2, turn=3))
    q, k, v = (x.detach() for x in _qkv(plan, 4, 2))
    for window in (1, 3, 7):
        ref = dense_attention_oracle(plan, q, k, v, 0.3, window=window)
        out = attend(plan, "flex", q, k, v, 0.3, AttentionFeatures(window=window))
        assert (out - ref).abs().max().item() <= TOL


def _mixed_rows():
    """Short questions and long responses behind a shared system prompt: the dense backends split the non-root
    nodes into several blocks (``plan.tree.child_buckets``)."""
    g = torch.Generator().manual_seed(5)
    rnd = lambda n: torch.randint(1, 50, (n,), generator=g).tolist()  # noqa: E731
    system = rnd(40)
    rows = []
    for q in range(3):
        prompt = system + rnd(3 + q)
        rows += [(prompt, rnd(L)) for L in (150, 120 + q, 7)]
    return rows


def test_blocks_of_mixed_lengths():
    plan = _tree_plan(_mixed_rows())
    assert len(plan.tree.child_buckets) >= 2, plan.tree.child_buckets
    _check_all(plan)
    for feat in (dict(window=9), dict(window=60, sinks=True, softcap=0.8)):
        for backend in FEATURE_BACKENDS:
            check_features(plan, backend, feat)
