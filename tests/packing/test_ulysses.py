"""The Ulysses shard layout of a plan (packing/ulysses.py): every response-predicting row is computed by exactly
one SP rank, at its local position, and the gather index puts the ranks' values back in original row order."""

import pytest
import torch

from zorro_verl.packing import build_plan
from zorro_verl.packing.ulysses import ulysses_shard
from zorro_verl.testing import create_dummy_batch


@pytest.mark.parametrize("sp", [1, 2, 3, 4])
@pytest.mark.parametrize("seed", [0, 1])
def test_shards_partition_rows_and_gather_restores_order(sp, seed):
    b = create_dummy_batch(batch_size=7, num_unique_prompts=3, prompt_len=6, response_len=5, device="cpu",
                           add_padding=True, vocab_size=50, seed=seed, shuffle=True)
    plan = build_plan(b["input_ids"], b["attention_mask"], 5)
    shards = [ulysses_shard(plan, sp, s) for s in range(sp)]
    L = shards[0].local_len
    assert L * sp >= plan.T > L * sp - sp  # padded to the next multiple of sp
    # the slices put together are the packed row, then the pad (id 0, position 0)
    ids = torch.cat([s.input_ids for s in shards])
    pos = torch.cat([s.position_ids for s in shards])
    assert torch.equal(ids[: plan.T], plan.input_ids) and torch.equal(pos[: plan.T], plan.position_ids)
    assert not ids[plan.T:].any() and not pos[plan.T:].any()
    rows = torch.cat([s.rows for s in shards])
    assert torch.equal(rows.sort().values, torch.arange(plan.N))  # each row on exactly one rank
    for s in shards:
        assert s.row_counts == shards[0].row_counts and s.rows.numel() == s.row_counts[s.rank]
        assert ((s.logit_index >= 0) & (s.logit_index < L)).all()
        # the local head row reads the same packed token as the plan's
        assert torch.equal(s.input_ids[s.logit_index], plan.input_ids[plan.logit_index[s.rows]])
        assert torch.equal(s.target_ids, plan.target_ids[s.rows])
    # simulate the all-gather: rank s's j-th value at s * max_rows + j
    m = shards[0].max_rows
    flat = torch.full((sp * m,), -1, dtype=torch.long)
    for s in shards:
        flat[s.rank * m: s.rank * m + s.rows.numel()] = s.rows
    assert torch.equal(flat[shards[0].gather_index], torch.arange(plan.N))


def test_bad_sp_arguments_raise():
    b = create_dummy_batch(batch_size=2, num_unique_prompts=1, prompt_len=3, response_len=2, device="cpu")
    plan = build_plan(b["input_ids"], b["attention_mask"], 2)
    with pytest.raises(ValueError, match="sp_size"):
        ulysses_shard(plan, 0, 0)
    with pytest.raises(ValueError, match="rank"):
        ulysses_shard(plan, 2, 2)


@pytest.mark.parametrize("sp", [1, 2, 3, 4])
def test_tree_shards_run_each_distinct_head_position_once(sp):
    """A prefix-tree plan: the shard layout is the prompt plan's over the tree's packed row; each rank's head rows
    are the distinct positions of its outputs, and together the ranks compute ``plan.head_index`` exactly once."""
    from zorro_verl.testing import batch_from_rows, multi_turn_rows, shared_system_rows

    rows = shared_system_rows(2, 3, system_len=7, question_len=2, response_len=4, vocab_size=50, seed=2)
    rows[1] = (rows[1][0], rows[0][1][:2] + rows[1][1][2:])  # two responses share their first 2 tokens
    rows.append(rows[0])  # an identical row: every position shared
    turns, _ = multi_turn_rows(3, first_prompt_len=4, turn_len=2, observation_len=1, vocab_size=50, seed=3)
    b = batch_from_rows(rows + turns)
    plan = build_plan(b["input_ids"], b["attention_mask"], b["responses"].shape[1], sharing="prefix",
                      min_shared_len=1)
    assert plan.head_index.numel() < plan.N
    shards = [ulysses_shard(plan, sp, s) for s in range(sp)]
    heads = []
    for s in shards:
        assert s.head_index is not None and s.head_inverse.shape == s.rows.shape
        assert torch.equal(s.head_index[s.head_inverse], s.logit_index)  # each output reads its own position
        assert s.head_index.unique().numel() == s.head_index.numel()
        heads.append(s.head_index + s.start)
    assert torch.equal(torch.cat(heads), plan.head_index)  # every distinct position once, on one rank
    prompt_plan = build_plan(b["input_ids"], b["attention_mask"], b["responses"].shape[1])
    assert ulysses_shard(prompt_plan, sp, 0).head_index is None  # the prompt plan's path is unchanged
