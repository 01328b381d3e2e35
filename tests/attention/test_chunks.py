"""Chunked attention (Llama 4's ``chunked_attention`` layers: key visible iff ``pos_q // C == pos_k // C``, causal)
in every backend vs the dense-mask oracle with the chunk rule (fp64, outputs and q/k/v/sink gradients), prompt and
prefix-tree plans: the flash designs (one segment per chunk piece) over the plain-torch varlen primitives and the
copy-free backend as registered on CPU (its CPU flash kernels); flex forward only."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.attention.test_tree_backends import _tree_plan
from tests.packing.test_plan import IDS, MASK, grpo_batches
from tests.packing.test_tree import tree_rows
from zorro_verl.attention import AttentionFeatures, attend
from zorro_verl.attention.copyfree import attend_copyfree
from zorro_verl.attention.primitives import torch_primitives
from zorro_verl.attention.varlen import attend_varlen
from zorro_verl.packing import build_plan
from zorro_verl.testing import dense_attention_oracle, dense_mask, multi_turn_rows

TOL = 1e-12  # fp64: both sides are the same math up to summation order
PRIMS = torch_primitives()
#: name -> attend(plan, q, k, v, scaling, features): the registered backends, and the flash designs with the CPU
#: reference kernels
VARIANTS = {
    "sdpa": lambda p, *a: attend(p, "sdpa", *a),
    "eager": lambda p, *a: attend(p, "eager", *a),
    "standard": lambda p, *a: attend(p, "standard", *a),
    "flash_copyfree": lambda p, *a: attend(p, "flash_copyfree", *a),  # as registered: its CPU flash kernels
    "flash": lambda p, q, k, v, s, f: attend_varlen(p, q, k, v, s, f.for_plan(p), prims=PRIMS),
    "flash_copyfree_prims": lambda p, q, k, v, s, f: attend_copyfree(p, q, k, v, s, f.for_plan(p), prims=PRIMS),
}
CHUNK_BACKENDS = tuple(VARIANTS)


def _check(plan, backend, chunk, window=None, sinks=False, softcap=None, hq=4, hkv=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()  # noqa: E731
    q, k, v = mk(1, hq, plan.T, 8), mk(1, hkv, plan.T, 8), mk(1, hkv, plan.T, 8)
    s = mk(hq) if sinks else None
    w = torch.randn(1, plan.T, hq, 8, generator=g, dtype=torch.float64)
    ref = dense_attention_oracle(plan, q, k, v, 0.7, window=window, sinks=s, softcap=softcap, chunk=chunk)
    out = VARIANTS[backend](plan, q, k, v, 0.7, AttentionFeatures(window=window, sinks=s, softcap=softcap,
                                                                 chunk=chunk))
    leaves = (q, k, v) + ((s,) if s is not None else ())
    errs = [(out - ref).abs().max().item()] + [
        (a - b).abs().max().item() for a, b in zip(torch.autograd.grad((out * w).sum(), leaves),
                                                   torch.autograd.grad((ref * w).sum(), leaves))]
    assert max(errs) <= TOL, f"{backend} chunk={chunk}: errors (out, dq, dk, dv[, dsinks]) {errs}"
    return errs


def test_dense_mask_chunk_is_transformers_rule_on_row_positions():
    """The oracle's chunk on the hand example and against transformers' own chunked mask of each row alone:
    row 0 = prompt [0, 1, 2] + response at positions 3, 4; chunk 2: position 3 sees position 2 of its prompt and
    itself, position 4 (chunk 2) only itself."""
    from transformers import LlamaConfig
    from transformers.masking_utils import create_chunked_causal_mask

    plan = build_plan(IDS, MASK, 3)
    m = dense_mask(plan, chunk=2)
    r0 = int(plan.response_start[0])
    assert m[r0].nonzero().flatten().tolist() == [2, r0]
    assert m[r0 + 1].nonzero().flatten().tolist() == [r0 + 1]
    assert torch.equal(dense_mask(plan, chunk=plan.max_row_len), dense_mask(plan))
    # each row alone: the plan's mask restricted to the row's tokens is transformers' chunked causal mask
    cfg = LlamaConfig(attention_chunk_size=2, hidden_size=8, num_attention_heads=1)
    cfg._attn_implementation = "sdpa"
    mc = dense_mask(plan, chunk=2)
    from zorro_verl.attention.standard import row_index
    ri = row_index(plan)["row_index"]
    for b in range(plan.B):
        L = int(plan.row_prompt_lens[b] + plan.response_lens[b])
        idx = ri[b, :L]
        hf = create_chunked_causal_mask(cfg, torch.zeros(1, L, 8), attention_mask=torch.ones(1, L, dtype=torch.long),
                                        past_key_values=None, position_ids=torch.arange(L)[None])
        assert torch.equal(mc[idx][:, idx], hf[0, 0]), b


@pytest.mark.parametrize("chunk", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("backend", CHUNK_BACKENDS)
def test_chunk_backends_match_oracle(backend, chunk):
    plan = build_plan(IDS, MASK, 3)
    _check(plan, backend, chunk)
    _check(plan, backend, chunk, window=2, sinks=True, softcap=1.1, seed=1)  # with the other features too


@settings(max_examples=10, deadline=None)
@given(grpo_batches(), st.integers(1, 8))
def test_chunk_over_random_structures(batch, chunk):
    """G = 1, G = B, unequal lengths, 0- and 1-token responses, interleaved siblings, any chunk."""
    ids, mask, R = batch
    plan = build_plan(ids, mask, R)
    for backend in CHUNK_BACKENDS:
        _check(plan, backend, chunk)


@settings(max_examples=8, deadline=None)
@given(tree_rows(), st.integers(1, 6))
def test_chunk_over_random_tries(case, chunk):
    rows, _, min_shared = case
    plan = _tree_plan(rows, min_shared)
    for backend in CHUNK_BACKENDS:
        _check(plan, backend, chunk)


def test_flex_forward_with_chunks():
    """FlexAttention (CPU: forward only): the chunk in the block mask, prompt and tree plans."""
    rows, _ = multi_turn_rows(3, first_prompt_len=4, turn_len=3, observation_len=2, trajectories=2, vocab_size=50)
    for plan in (build_plan(IDS, MASK, 3), _tree_plan(rows)):
        for chunk, window in ((2, None), (3, 2)):
            g = torch.Generator().manual_seed(chunk)
            q, k, v = (torch.randn(1, h, plan.T, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
            ref = dense_attention_oracle(plan, q, k, v, 0.7, window=window, chunk=chunk)
            out = attend(plan, "flex", q, k, v, 0.7, AttentionFeatures(window=window, chunk=chunk))
            assert (out - ref).abs().max().item() <= TOL, (chunk, window)


def test_chunk_pieces_of_the_flash_design():
    """The hand example, chunk 2: prompt [5, 6, 7] -> pieces of 2 and 1 tokens; row 0's response (positions 3, 4;
    prefix 3) -> a query-less piece over prompt positions 0-1, then [prompt position 2 ; response position 3] with
    one query, then position 4 alone."""
    from zorro_verl.attention.varlen import chunk_index

    plan = build_plan(IDS, MASK, 3)
    c = chunk_index(plan, 2)
    assert plan.prompt_lens.tolist()[0] == 3 and c["cu_seqlens_prompt"].diff().tolist()[:2] == [2, 1]
    row0 = plan.nonempty_rows().tolist().index(0)
    m = c["cu_seqlens_q"].numel() - 1
    per = m // plan.num_nonempty_responses
    ql = c["cu_seqlens_q"].diff().view(-1, per)[row0].tolist()
    kl = c["cu_seqlens_k"].diff().view(-1, per)[row0].tolist()
    assert ql[:3] == [0, 1, 1] and kl[:3] == [2, 2, 1] and sum(ql[3:]) == sum(kl[3:]) == 0


def test_bad_chunk_refused():
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="attention_chunk_size"):
            AttentionFeatures(chunk=bad)
