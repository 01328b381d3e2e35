"""The context-parallel layout of a plan (packing/context_parallel.py): every packed token on exactly one rank, the
ranks' token counts and causal costs balanced, every response-predicting row computed by one rank and gathered
back in original order; the communication figures against hand formulas."""

import pytest
import torch

from zorro_verl.packing import build_plan
from zorro_verl.packing.context_parallel import (
    cp_costs,
    cp_kv_bytes,
    cp_shard,
    cp_split,
    stock_cp_local_tokens,
)
from zorro_verl.testing import batch_from_rows, create_dummy_batch, multi_turn_rows, shared_system_rows


def _prompt_plan(seed=0, B=7, G=3, P=6, R=5):
    b = create_dummy_batch(batch_size=B, num_unique_prompts=G, prompt_len=P, response_len=R, device="cpu",
                           add_padding=True, vocab_size=50, seed=seed, shuffle=True)
    return build_plan(b["input_ids"], b["attention_mask"], R)


def _tree_plan():
    rows = shared_system_rows(2, 3, system_len=7, question_len=2, response_len=4, vocab_size=50, seed=2)
    rows[1] = (rows[1][0], rows[0][1][:2] + rows[1][1][2:])
    turns, _ = multi_turn_rows(3, first_prompt_len=4, turn_len=2, observation_len=1, vocab_size=50, seed=3)
    b = batch_from_rows(rows + turns)
    return build_plan(b["input_ids"], b["attention_mask"], b["responses"].shape[1], sharing="prefix",
                      min_shared_len=1)


def test_split_of_one_run_is_verl_zigzag():
    """One run of 8 tokens at cp = 2: rank pairs (piece k, piece 3 - k), as verl's zigzag cuts an ordinary row; the
    causal costs are equal (1+2+7+8 = 3+4+5+6 = 18)."""
    pos = torch.arange(8)
    index = cp_split(pos, 2)
    assert sorted(map(tuple, index.tolist())) == [(0, 1, 6, 7), (2, 3, 4, 5)]
    assert cp_costs(pos, index).tolist() == [18, 18]


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("multiple", [1, 2])
@pytest.mark.parametrize("kind", ["prompt0", "prompt1", "tree"])
def test_shards_partition_tokens_balance_and_gather_restores_order(cp, multiple, kind):
    plan = _tree_plan() if kind == "tree" else _prompt_plan(seed=int(kind[-1]))
    shards = [cp_shard(plan, cp, r, multiple=multiple) for r in range(cp)]
    L, T = shards[0].local_len, plan.T
    assert L % multiple == 0
    index = torch.stack([s.index for s in shards])
    # every packed token exactly once; pads are T
    assert torch.equal(index[index < T].sort().values, torch.arange(T))
    counts = (index < T).sum(1)
    # a rank's slice is at most a few tokens longer than T / cp (each run's pairs differ by <= 2 tokens and go to
    # the rank with the fewest), before rounding to the multiple
    assert L <= -(-(-(-T // cp) + 2) // multiple) * multiple
    assert int(counts.max() - counts.min()) <= 2
    # causal cost balanced within the costliest token of the row of each rank's mean
    costs = cp_costs(plan.position_ids, index).double()
    assert float(costs.max() - costs.min()) <= 2 * plan.max_row_len
    for s in shards:
        assert torch.equal(s.valid, s.index < T)
        assert torch.equal(s.index[s.valid], s.index[s.valid].sort().values)  # packed order inside a rank
        assert torch.equal(s.input_ids[s.valid], plan.input_ids[s.index[s.valid]])
        assert torch.equal(s.position_ids[s.valid], plan.position_ids[s.index[s.valid]])
        assert not s.input_ids[~s.valid].any() and not s.position_ids[~s.valid].any()
        # the all-gathered rank-major buffer holds each packed token at gathered_index
        assert torch.equal(index.flatten()[s.gathered_index], torch.arange(T))
        assert s.row_counts == shards[0].row_counts and s.rows.numel() == s.row_counts[s.rank]
        assert torch.equal(s.index[s.logit_index], plan.logit_index[s.rows])  # the local row reads the same token
        assert torch.equal(s.target_ids, plan.target_ids[s.rows])
    rows = torch.cat([s.rows for s in shards])
    assert torch.equal(rows.sort().values, torch.arange(plan.N))
    m = shards[0].max_rows
    flat = torch.full((cp * m,), -1, dtype=torch.long)
    for s in shards:
        flat[s.rank * m: s.rank * m + s.rows.numel()] = s.rows
    assert torch.equal(flat[shards[0].gather_index], torch.arange(plan.N))
    if kind == "tree":
        heads = torch.cat([s.index[s.head_index] for s in shards]).sort().values
        assert torch.equal(heads, plan.head_index.sort().values)  # each distinct head position once


def test_balance_beats_contiguous_split_on_long_prompt():
    """A long prompt with short responses: contiguous halves put the prompt's cheap front on one rank and its
    expensive back plus the responses on the other; the zigzag layout's costs differ by under 2% of the total, and
    by under half the contiguous split's imbalance."""
    plan = _prompt_plan(seed=0, B=8, G=2, P=64, R=8)
    index = cp_split(plan.position_ids, 2)
    costs = cp_costs(plan.position_ids, index).double()
    zig = float((costs.max() - costs.min()) / costs.sum())
    assert zig < 0.02
    half = -(-plan.T // 2)
    contiguous = torch.full((2, half), plan.T)
    contiguous.view(-1)[: plan.T] = torch.arange(plan.T)
    c = cp_costs(plan.position_ids, contiguous).double()
    assert float((c.max() - c.min()) / c.sum()) > 2 * zig  # measured 4.1% vs 1.4%


def test_bytes_against_hand_formulas():
    # all-gather of k and v: the other cp - 1 ranks' L tokens, 2 tensors of Hkv * D elements
    got = cp_kv_bytes(local_len=100, cp_size=4, num_kv_heads=2, head_dim=16, element_size=2)
    assert got == 3 * 100 * 2 * 16 * 2 * 2
    assert cp_kv_bytes(local_len=100, cp_size=1, num_kv_heads=2, head_dim=16, element_size=2) == 0
    # verl pads each row to a multiple of tp * cp * 2 under zigzag CP
    assert stock_cp_local_tokens([5, 13, 16], cp_size=2, tp_size=1) == (8 + 16 + 16) // 2
    assert stock_cp_local_tokens([5, 13, 16], cp_size=2, tp_size=2) == (8 + 16 + 16) // 2
    assert stock_cp_local_tokens([5, 13, 17], cp_size=2, tp_size=2) == (8 + 16 + 24) // 2
    assert stock_cp_local_tokens([5], cp_size=1, tp_size=2) == 6


def test_bad_arguments_raise():
    plan = _prompt_plan()
    with pytest.raises(ValueError, match="cp_size"):
        cp_shard(plan, 0, 0)
    with pytest.raises(ValueError, match="rank"):
        cp_shard(plan, 2, 2)
    with pytest.raises(ValueError, match="multiple"):
        cp_split(plan.position_ids, 2, 0)
