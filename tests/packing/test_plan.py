"""Packing layer: hand-written expected indices, validation, and properties over random group structures."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zorro_verl.packing import build_plan, group_ids
from zorro_verl.testing import dense_mask

# Two groups, siblings not adjacent, left-padded prompts, right-padded responses, one empty response.
#   row 0: prompt [5 6 7]  response [1 2]      row 1: prompt [9 8]   response [3 4 4]
#   row 2: prompt [5 6 7]  response []         row 3: prompt [5 6 7] response [6]
IDS = torch.tensor([
    [5, 6, 7, 1, 2, 0],
    [0, 9, 8, 3, 4, 4],
    [5, 6, 7, 0, 0, 0],
    [5, 6, 7, 6, 0, 0],
])
MASK = torch.tensor([
    [1, 1, 1, 1, 1, 0],
    [0, 1, 1, 1, 1, 1],
    [1, 1, 1, 0, 0, 0],
    [1, 1, 1, 1, 0, 0],
])


def test_hand_written_small_case():
    p = build_plan(IDS, MASK, 3)
    assert (p.B, p.S, p.R, p.G, p.T, p.N) == (4, 6, 3, 2, 11, 6)
    # packed row: [P0=5 6 7 | R0=1 2 | R2=() | R3=6 | P1=9 8 | R1=3 4 4]
    assert p.input_ids.tolist() == [5, 6, 7, 1, 2, 6, 9, 8, 3, 4, 4]
    assert p.position_ids.tolist() == [0, 1, 2, 3, 4, 3, 0, 1, 2, 3, 4]
    assert p.row_group.tolist() == [0, 1, 0, 0]
    assert p.group_rep_row.tolist() == [0, 1]
    assert p.group_sizes.tolist() == [3, 1]
    assert p.prompt_lens.tolist() == [3, 2]
    assert p.response_lens.tolist() == [2, 3, 0, 1]
    assert p.prompt_start.tolist() == [0, 6]
    assert p.response_start.tolist() == [3, 8, 5, 5]
    # original row order: row0 (2 tokens), row1 (3), row3 (1)
    assert p.logit_index.tolist() == [2, 3, 7, 8, 9, 2]
    assert p.target_ids.tolist() == [1, 2, 3, 4, 4, 6]
    assert p.out_row.tolist() == [0, 0, 1, 1, 1, 3]
    assert p.out_col.tolist() == [0, 1, 0, 1, 2, 0]
    assert (p.max_prompt_len, p.max_response_len, p.max_row_len) == (3, 3, 5)
    assert p.ordinary_tokens == 5 + 5 + 3 + 4
    assert p.groups() == [[0, 2, 3], [1]]
    assert p.nonempty_rows().tolist() == [0, 3, 1]  # packed order, empty row 2 left out
    assert p.full_index().tolist() == [
        [0, 1, 2, 3, 4, -1], [-1, 6, 7, 8, 9, 10], [0, 1, 2, -1, -1, -1], [0, 1, 2, 5, -1, -1]]


def test_pad_id_token_is_not_padding():
    # Token 0 is the pad id, but in row 1 it is a real prompt token: the prompts differ.
    ids = torch.tensor([[0, 3, 4, 9], [0, 3, 4, 9]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    p = build_plan(ids, mask, 1)
    assert p.G == 2 and p.prompt_lens.tolist() == [2, 3]


def test_zero_width_response_and_all_empty_responses():
    ids = torch.tensor([[1, 2, 3], [1, 2, 3]])
    p = build_plan(ids, None, 0)
    assert (p.G, p.T, p.N) == (1, 3, 0)
    p = build_plan(torch.tensor([[1, 2, 0], [1, 2, 0]]), torch.tensor([[1, 1, 0], [1, 1, 0]]), 1)
    assert (p.G, p.T, p.N, p.max_response_len) == (1, 2, 0, 0)


@pytest.mark.parametrize("kwargs,match", [
    (dict(input_ids=torch.zeros(0, 4, dtype=torch.long), attention_mask=None, response_width=1), "empty batch"),
    (dict(input_ids=torch.ones(2, 4, dtype=torch.long), attention_mask=None, response_width=4), "response_width"),
    (dict(input_ids=torch.ones(2, 4, dtype=torch.long), attention_mask=None, response_width=5), "response_width"),
    (dict(input_ids=torch.ones(2, 4, dtype=torch.long), attention_mask=torch.ones(2, 3), response_width=1),
     "attention_mask: expected shape"),
    (dict(input_ids=torch.ones(2, 4, dtype=torch.long), attention_mask=torch.full((2, 4), 2), response_width=1),
     "only 0 and 1"),
    (dict(input_ids=torch.ones(2, 4, dtype=torch.long),
          attention_mask=torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]]), response_width=1), "left padded"),
    (dict(input_ids=torch.ones(2, 4, dtype=torch.long),
          attention_mask=torch.tensor([[1, 1, 0, 1], [1, 1, 1, 1]]), response_width=2), "right padded"),
    (dict(input_ids=torch.ones(2, 4, dtype=torch.long),
          attention_mask=torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]), response_width=2), "no valid prompt token"),
    (dict(input_ids=torch.ones(2, 4), attention_mask=None, response_width=1), "input_ids: expected dtype"),
    (dict(input_ids=torch.ones(2, 3, 4, dtype=torch.long), attention_mask=None, response_width=1), "2-D"),
])
def test_bad_input_raises(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        build_plan(**kwargs)


def test_bad_position_ids():
    ids = torch.tensor([[1, 2, 3, 4]])
    with pytest.raises(ValueError, match="position_ids"):
        build_plan(ids, None, 1, position_ids=torch.tensor([[1, 2, 3, 4]]))
    with pytest.raises(ValueError, match="position_ids: expected shape"):
        build_plan(ids, None, 1, position_ids=torch.zeros(1, 3, 4, dtype=torch.long)[0])
    with pytest.raises(TypeError, match="backend"):  # the plan holds no backend: it is chosen per step
        build_plan(ids, None, 1, backend="sdpa")


# ----------------------------------------------------------------------------- properties
@st.composite
def grpo_batches(draw):
    """Random group structures: G groups of random sizes, random prompt/response lengths (0 allowed for
    responses), shuffled rows, random pad widths and a pad id that also occurs as a real token."""
    G = draw(st.integers(1, 4))
    sizes = [draw(st.integers(1, 4)) for _ in range(G)]
    Pw = draw(st.integers(1, 6))
    R = draw(st.integers(0, 5))
    plens = [draw(st.integers(1, Pw)) for _ in range(G)]
    vocab = draw(st.integers(2, 5))  # small vocab: collisions between prompts of different groups are likely
    prompts = [[draw(st.integers(0, vocab)) for _ in range(p)] for p in plens]
    rows, masks = [], []
    for g in range(G):
        for _ in range(sizes[g]):
            r = draw(st.integers(0, R))
            resp = [draw(st.integers(0, vocab)) for _ in range(r)]
            rows.append([0] * (Pw - plens[g]) + prompts[g] + resp + [0] * (R - r))
            masks.append([0] * (Pw - plens[g]) + [1] * plens[g] + [1] * r + [0] * (R - r))
    perm = draw(st.permutations(range(len(rows))))
    ids = torch.tensor([rows[i] for i in perm])
    mask = torch.tensor([masks[i] for i in perm])
    return ids, mask, R


@settings(max_examples=150, deadline=None)
@given(grpo_batches())
def test_plan_properties(batch):
    ids, mask, R = batch
    B, S = ids.shape
    Pw = S - R
    p = build_plan(ids, mask, R)
    # groups = equality of valid prompt token sequences, numbered by first appearance
    keys = [tuple(ids[b, :Pw][mask[b, :Pw].bool()].tolist()) for b in range(B)]
    first = {}
    for k in keys:
        first.setdefault(k, len(first))
    assert p.row_group.tolist() == [first[k] for k in keys]
    assert p.G == len(first)
    assert p.T == sum(len(k) for k in first) + int(mask[:, Pw:].sum())
    assert p.ordinary_tokens == int(mask.sum())
    resp_per_group = [sum(int(mask[b, Pw:].sum()) for b in range(B) if keys[b] == k) for k in first]
    answered = [len(k) for k, n in zip(first, resp_per_group) if n > 0]
    assert p.group_counts == (len(answered), max(resp_per_group), max(answered, default=0), sum(answered))
    # every valid token maps to a packed token with the same id and verl's position
    fi = p.full_index()
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    valid = mask.bool()
    assert ((fi >= 0) == valid).all()
    assert (p.input_ids[fi[valid]] == ids[valid]).all()
    assert (p.position_ids[fi[valid]] == pos[valid]).all()
    # each packed token is read back from a row holding it
    assert (ids.reshape(-1)[p.source_index] == p.input_ids).all()
    # response-predicting rows: the token just before each response token in its own row (never a roll)
    col = Pw + p.out_col
    assert (p.target_ids == ids[p.out_row, col]).all()
    assert (p.logit_index == fi[p.out_row, col - 1]).all()
    # [B, R] round trip of per-token values
    vals = torch.arange(p.N, dtype=torch.float64)
    padded = p.to_padded(vals)
    assert (p.from_padded(padded) == vals).all()
    assert (padded[~mask[:, Pw:].bool()] == 0).all()
    # the attention structure: token i sees token j iff they are in one row's [prompt | own response], j <= i
    dm = dense_mask(p)
    expect = torch.zeros(p.T, p.T, dtype=torch.bool)
    for b in range(B):
        toks = fi[b][fi[b] >= 0]
        for a in range(toks.numel()):
            expect[toks[a], toks[: a + 1]] = True
    assert (dm == expect).all()


def test_plan_survives_fsdp_style_input_casting():
    """FSDP2 casts forward kwargs with torch.distributed.utils._apply_to_tensors, which rebuilds dataclasses and
    dicts. The copy must share the memo (the index sets built from it) with the original."""
    from torch.distributed.utils import _apply_to_tensors

    p = build_plan(IDS, MASK, 3)
    built = p.token_layout()
    copy = _apply_to_tensors(lambda t: t, p)
    assert copy is not p and copy.memo is p.memo
    assert copy.token_layout() is built


def test_group_ids_first_appearance_and_pad_id():
    # rows 0 and 2 share the prompt [5, 6]; row 1's real token 0 equals the pad id but is not padding
    ids = torch.tensor([[0, 5, 6], [0, 5, 6], [9, 5, 6], [7, 7, 7]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1]]).bool()
    assert group_ids(ids, mask).tolist() == [0, 1, 0, 2]
    assert group_ids(ids[[3, 1, 0, 2]], mask[[3, 1, 0, 2]]).tolist() == [0, 1, 2, 2]
    with pytest.raises(ValueError, match="prompt_mask"):
        group_ids(ids, mask[:, :2])
