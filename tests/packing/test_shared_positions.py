"""``check_shared_positions``: the 3-D position check a vision-language batch passes before the ranks agree on its
path (docs/design/verl.md, the engine's batch checks), against the plan-level check it anticipates
(``packed_positions``)."""

import pytest
import torch

from zorro_verl.packing import build_plan
from zorro_verl.packing.multimodal import check_shared_positions, packed_positions


def _batch():
    """4 rows, right-padded: rows 0 / 2 share the prompt [5, 6, 7], row 1 = [5, 6, 8] (a shared prefix [5, 6] only),
    row 3 alone; positions [3, B, S] counting along each row (as get_rope_index gives for text)."""
    ids = torch.tensor([[5, 6, 7, 1, 2, 0], [5, 6, 8, 3, 0, 0], [5, 6, 7, 4, 4, 4], [9, 9, 1, 0, 0, 0]])
    p = torch.tensor([3, 3, 3, 2])
    lengths = torch.tensor([5, 4, 6, 3])
    pos = torch.arange(6).expand(3, 4, 6).clone()
    return ids, p, lengths, pos


def test_consistent_positions_pass():
    ids, p, lengths, pos = _batch()
    check_shared_positions(ids, lengths, pos, shared_cap=p)
    check_shared_positions(ids, lengths, pos)
    check_shared_positions(ids, lengths, torch.cat([pos[:1], pos]))  # verl's 4-row layout: text positions first


def test_a_row_of_a_group_with_other_positions_is_refused_as_the_plan_would():
    ids, p, lengths, pos = _batch()
    pos[1, 2, 1] += 1  # row 2's second prompt token, height axis: row 0 shares it
    with pytest.raises(ValueError, match=r"rows 0 and 2 share their first 3 tokens but have different 3-D"):
        check_shared_positions(ids, lengths, pos, shared_cap=p)
    # the plan-level check (after the ranks agree) refuses the same batch
    am = (torch.arange(6) < lengths[:, None]).long()
    plan = build_plan(ids, am, 3)
    with pytest.raises(ValueError, match="different 3-D positions"):
        packed_positions(plan, pos)


def test_what_is_not_shared_may_differ():
    ids, p, lengths, pos = _batch()
    pos[:, 3] += 7  # row 3 shares no token
    pos[:, 0, 3:] += 1  # row 0's response (its first token differs from row 2's: nothing shared there)
    check_shared_positions(ids, lengths, pos, shared_cap=p)
    check_shared_positions(ids, lengths, pos)


def test_the_cap_limits_the_check_to_the_prompts():
    """Rows 0 / 2 with equal responses' first tokens: a prefix tree shares them, prompt sharing does not."""
    ids, p, lengths, pos = _batch()
    ids[2, 3] = 1  # row 2's response now starts as row 0's
    pos[:, 2, 3] += 1
    check_shared_positions(ids, lengths, pos, shared_cap=p)
    with pytest.raises(ValueError, match="rows 0 and 2 share their first 4 tokens"):
        check_shared_positions(ids, lengths, pos)


def test_a_common_prefix_across_groups_is_checked():
    """Row 1 shares [5, 6] with rows 0 / 2 (another prompt): a trie node under prefix sharing; under prompt sharing
    not shared, but the same tokens have the same positions in any correct batch, so the check covers them too."""
    ids, p, lengths, pos = _batch()
    pos[2, 1, 1] += 1
    for cap in (p, None):
        with pytest.raises(ValueError, match="share their first 2 tokens"):
            check_shared_positions(ids, lengths, pos, shared_cap=cap)
