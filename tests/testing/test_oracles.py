"""The dense-mask and dense-attention oracles of zorro_verl.testing against brute-force per-pair rules."""

import types

import pytest
import torch

from zorro_verl.packing import build_plan
from zorro_verl.testing import create_dummy_batch, dense_attention_oracle, dense_mask

# packed row: [P0=5 6 7 | R0=1 2 | R2=() | R3=6 | P1=9 8 | R1=3 4 4]
IDS = torch.tensor([[5, 6, 7, 1, 2, 0], [0, 9, 8, 3, 4, 4], [5, 6, 7, 0, 0, 0], [5, 6, 7, 6, 0, 0]])
MASK = torch.tensor([[1, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0]])


def _plans():
    yield build_plan(IDS, MASK, 3)
    for seed, (B, G, P, R) in enumerate([(6, 2, 5, 4), (7, 3, 4, 3), (5, 5, 3, 2), (4, 1, 6, 5)]):
        b = create_dummy_batch(batch_size=B, num_unique_prompts=G, prompt_len=P, response_len=R, device="cpu",
                               add_padding=True, shuffle=True, seed=seed)
        yield build_plan(b["input_ids"], b["attention_mask"], R)


def brute_force_mask(plan) -> torch.Tensor:
    """Per pair: k <= q, same group, and k a prompt token or in q's own segment — from the plan's core fields."""
    owner = {}  # packed position -> (group, segment)
    for g in range(plan.G):
        for t in range(int(plan.prompt_start[g]), int(plan.prompt_start[g] + plan.prompt_lens[g])):
            owner[t] = (g, ("prompt", g))
    for b in range(plan.B):
        for t in range(int(plan.response_start[b]), int(plan.response_start[b] + plan.response_lens[b])):
            owner[t] = (int(plan.row_group[b]), ("response", b))
    assert sorted(owner) == list(range(plan.T))
    m = torch.zeros(plan.T, plan.T, dtype=torch.bool)
    for q in range(plan.T):
        for k in range(q + 1):
            (gq, sq), (gk, sk) = owner[q], owner[k]
            m[q, k] = gq == gk and (sk[0] == "prompt" or sk == sq)
    return m


def test_dense_mask_hand_written_case():
    m = dense_mask(build_plan(IDS, MASK, 3))
    assert m.shape == (11, 11) and m.dtype == torch.bool
    assert m[3].nonzero().flatten().tolist() == [0, 1, 2, 3]  # R0's first token: its prompt and itself
    assert m[5].nonzero().flatten().tolist() == [0, 1, 2, 5]  # R3: its prompt, not R0
    assert m[10].nonzero().flatten().tolist() == [6, 7, 8, 9, 10]  # R1: group 1 only


@pytest.mark.parametrize("i", range(5))
def test_dense_mask_equals_brute_force(i):
    plan = list(_plans())[i]
    m = dense_mask(plan)
    assert torch.equal(m, brute_force_mask(plan))
    if hasattr(plan, "dense_mask"):  # while the plan still has the method this replaces
        assert torch.equal(m, plan.dense_mask())


def test_dense_mask_refuses_a_malformed_plan():
    plan = build_plan(IDS, MASK, 3)
    fields = {k: getattr(plan, k) for k in ("T", "G", "B", "row_group", "prompt_start", "prompt_lens",
                                            "response_start", "response_lens")}
    overlap = types.SimpleNamespace(**{**fields, "response_start": plan.response_start.clone().fill_(0)})
    with pytest.raises(ValueError, match="plan: expected"):
        dense_mask(overlap)
    short = types.SimpleNamespace(**{**fields, "T": plan.T + 1})
    with pytest.raises(ValueError, match="tile"):
        dense_mask(short)


def _brute_force_attention(mask, q, k, v, scaling):
    """Per head and query: softmax over its visible keys only (no -inf masking), in fp64."""
    hq, hkv, T = q.shape[1], k.shape[1], q.shape[2]
    out = torch.zeros(1, T, hq, q.shape[-1], dtype=torch.float64)
    for h in range(hq):
        kh = h // (hq // hkv)
        for t in range(T):
            keys = mask[t].nonzero().flatten()
            w = torch.softmax((k[0, kh, keys].double() @ q[0, h, t].double()) * scaling, 0)
            out[0, t, h] = w @ v[0, kh, keys].double()
    return out


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (6, 1)])
def test_dense_attention_oracle_equals_brute_force(hq, hkv):
    plan = build_plan(IDS, MASK, 3)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, plan.T, 8, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv))
    out = dense_attention_oracle(plan, q, k, v, 0.3)
    assert out.shape == (1, plan.T, hq, 8) and out.dtype == torch.float64
    assert (out - _brute_force_attention(brute_force_mask(plan), q, k, v, 0.3)).abs().max().item() <= 1e-13


def test_dense_attention_oracle_keeps_dtype_and_checks_shapes():
    plan = build_plan(IDS, MASK, 3)
    q, k = torch.randn(1, 4, plan.T, 8), torch.randn(1, 2, plan.T, 8)
    assert dense_attention_oracle(plan, q, k, k, 1.0).dtype == torch.float32
    with pytest.raises(ValueError, match="q, k, v: expected"):
        dense_attention_oracle(plan, q[:, :, :-1], k, k, 1.0)
    with pytest.raises(ValueError, match="multiple"):
        dense_attention_oracle(plan, q, torch.randn(1, 3, plan.T, 8), torch.randn(1, 3, plan.T, 8), 1.0)
