"""Sliding windows, attention sinks and logit soft-capping in every backend vs the dense-mask oracle (fp64):
outputs and the gradients of q, k, v and the sinks. The flash backends run on CPU over the plain-torch varlen
primitives (the same index and merge logic as on GPU, the kernels replaced by the reference)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.attention.test_copyfree import window_of
from tests.packing.test_plan import IDS, MASK, grpo_batches
from zorro_verl.attention import AttentionFeatures, attend
from zorro_verl.attention.copyfree import attend_copyfree
from zorro_verl.attention.primitives import torch_primitives, varlen_attention
from zorro_verl.attention.varlen import attend_varlen
from zorro_verl.packing import build_plan
from zorro_verl.testing import create_dummy_batch, dense_attention_oracle, dense_mask

TOL = 1e-12  # fp64: both sides are the same math up to summation order
PRIMS = torch_primitives()
#: name -> attend(plan, q, k, v, scaling, features); the flash designs with the CPU reference kernels, and the
#: copy-free backend as registered (its CPU flash kernels)
BACKENDS = {
    "sdpa": lambda p, q, k, v, s, f: attend(p, "sdpa", q, k, v, s, f),
    "eager": lambda p, q, k, v, s, f: attend(p, "eager", q, k, v, s, f),
    "standard": lambda p, q, k, v, s, f: attend(p, "standard", q, k, v, s, f),
    "flash": lambda p, q, k, v, s, f: attend_varlen(p, q, k, v, s, f.for_plan(p), prims=PRIMS),
    "flash_copyfree": lambda p, q, k, v, s, f: attend_copyfree(p, q, k, v, s, f.for_plan(p), prims=PRIMS),
    # the registered backend on CPU: PyTorch's CPU flash kernels (windows / soft-caps take the plain math)
    "flash_copyfree_cpu": lambda p, q, k, v, s, f: attend(p, "flash_copyfree", q, k, v, s, f),
}
FEATURES = {
    "window1": dict(window=1),
    "window3": dict(window=3),
    "window5": dict(window=5),
    "sinks": dict(sinks=True),
    "softcap": dict(softcap=0.7),
    "all": dict(window=4, sinks=True, softcap=1.3),
}


def _inputs(plan, hq, hkv, feat, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()  # noqa: E731
    q, k, v = mk(1, hq, plan.T, d), mk(1, hkv, plan.T, d), mk(1, hkv, plan.T, d)
    sinks = mk(hq) if feat.get("sinks") else None
    w = torch.randn(1, plan.T, hq, d, generator=g, dtype=torch.float64)
    return q, k, v, sinks, w


def _check(plan, backend, feat, hq=4, hkv=2, seed=0):
    q, k, v, sinks, w = _inputs(plan, hq, hkv, feat, seed=seed)
    window, softcap = feat.get("window"), feat.get("softcap")
    ref = dense_attention_oracle(plan, q, k, v, 0.9, window=window, sinks=sinks, softcap=softcap)
    out = BACKENDS[backend](plan, q, k, v, 0.9, AttentionFeatures(window=window, sinks=sinks, softcap=softcap))
    leaves = (q, k, v) + ((sinks,) if sinks is not None else ())
    g_ref = torch.autograd.grad((ref * w).sum(), leaves)
    g_out = torch.autograd.grad((out * w).sum(), leaves)
    errs = [(out - ref).abs().max().item()] + [(a - b).abs().max().item() for a, b in zip(g_ref, g_out)]
    assert max(errs) <= TOL, f"{backend} {feat}: errors (out, dq, dk, dv[, dsinks]) {errs}"
    return errs


@pytest.mark.parametrize("feat", sorted(FEATURES))
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_backends_match_oracle_with_features(backend, feat):
    _check(build_plan(IDS, MASK, 3), backend, FEATURES[feat], hq=4, hkv=2)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("window", [1, 2, 6, 11, 12, 40])
def test_windows_cutting_inside_some_prompts_and_not_others(backend, window):
    """Ragged prompts (up to 11 tokens) and responses (up to 6), siblings interleaved, 1-token responses: a window
    of 6 cuts inside every long prompt for a response's first token but not inside the short ones; 12 and 40 cut
    nothing (dropped as a no-op for rows of at most 17 tokens only when >= the longest row)."""
    b = create_dummy_batch(7, 3, 11, 6, device="cpu", add_padding=True, shuffle=True, seed=5)
    plan = build_plan(b["input_ids"], b["attention_mask"], 6)
    assert plan.G == 3 and int(plan.response_lens.min()) <= 1
    _check(plan, backend, dict(window=window, sinks=True), hq=6, hkv=3, seed=window)


@settings(max_examples=12, deadline=None)
@given(grpo_batches(), st.integers(1, 9), st.booleans(), st.booleans())
def test_over_random_structures(batch, window, sinks, softcap):
    """G = 1, G = B, unequal lengths, 0- and 1-token responses, interleaved siblings, any window."""
    ids, mask, R = batch
    plan = build_plan(ids, mask, R)
    feat = dict(window=window, sinks=sinks, softcap=0.8 if softcap else None)
    for backend in BACKENDS:
        _check(plan, backend, feat)


def test_window_key_buffer_longer_than_the_row():
    """The window call's key buffer (``K = Bnz * min(Pmax, W - 1) + N`` entries, the unused rest filled) can be longer
    than the packed row: a 6-token prompt with a 0- and a 2-token response, three 1-token prompts with 1-token
    responses, window 7 -> K = 29 > T = 12 (found by the random-structure test: the filler read past the row)."""
    ids = torch.zeros(5, 8, dtype=torch.long)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0], [1] * 8] + [[0, 0, 0, 0, 0, 1, 1, 0]] * 3)
    plan = build_plan(ids, mask, 2)
    assert plan.T == 12 and plan.num_nonempty_responses * 6 + plan.N > plan.T
    for backend in BACKENDS:
        _check(plan, backend, dict(window=7))


def test_flex_forward_with_features():
    """FlexAttention (CPU: forward only): window in the block mask, soft-cap as score_mod, sinks via its lse."""
    plan = build_plan(IDS, MASK, 3)
    for feat in FEATURES.values():
        q, k, v, sinks, _ = _inputs(plan, 4, 2, feat)
        q, k, v = q.detach(), k.detach(), v.detach()
        sinks = None if sinks is None else sinks.detach()
        f = AttentionFeatures(window=feat.get("window"), sinks=sinks, softcap=feat.get("softcap"))
        ref = dense_attention_oracle(plan, q, k, v, 0.9, window=f.window, sinks=sinks, softcap=f.softcap)
        out = attend(plan, "flex", q, k, v, 0.9, f)
        assert (out - ref).abs().max().item() <= TOL, feat


def test_dense_mask_window_is_transformers_rule_on_row_positions():
    """The oracle's window on the hand example: row 0 = prompt [0,1,2] + response [3,4] (positions 3, 4): with
    window 2, response token at position 4 sees positions 3 and 4 only — its prompt is outside."""
    plan = build_plan(IDS, MASK, 3)
    full, win = dense_mask(plan), dense_mask(plan, 2)
    q = int(plan.response_start[0]) + 1  # position 4 of row 0
    assert full[q].nonzero().flatten().tolist() == [0, 1, 2, q - 1, q]
    assert win[q].nonzero().flatten().tolist() == [q - 1, q]
    assert torch.equal(dense_mask(plan, 100), full)


def test_torch_primitive_window_is_flash_attn_bottom_right_band():
    """The plugged reference primitive keeps key j of query i iff 0 <= (i + lk - lq) - j < W (causal) and
    (i + lk - lq) - j < W (non-causal), as flash-attn's window_size=(W-1, 0 | -1) does; soft-cap included."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, 4, 8, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(7, 2, 8, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(7, 2, 8, dtype=torch.float64, generator=g, requires_grad=True)
    cu_q, cu_k = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 7], dtype=torch.int32)
    d = torch.arange(3)[:, None] + 4 - torch.arange(7)[None, :]  # [3, 7]
    for causal in (True, False):
        allowed = (d < 3) & ((d >= 0) if causal else True)
        out = varlen_attention(q, k, v, cu_q, cu_k, 3, 7, 0.4, causal, PRIMS, window=3, softcap=0.5)
        qh = q.transpose(0, 1)
        kh, vh = (x.transpose(0, 1).repeat_interleave(2, 0) for x in (k, v))
        s = 0.5 * torch.tanh(qh @ kh.transpose(1, 2) * 0.4 / 0.5)
        ref = (torch.softmax(s.masked_fill(~allowed, float("-inf")), -1) @ vh).transpose(0, 1)
        w = torch.randn_like(ref)
        for a, b in zip((out, *torch.autograd.grad((out * w).sum(), (q, k, v))),
                        (ref, *torch.autograd.grad((ref * w).sum(), (q, k, v)))):
            assert (a - b).abs().max().item() <= TOL


def test_bad_features_are_refused():
    with pytest.raises(ValueError, match="sliding_window"):
        AttentionFeatures(window=0)
    with pytest.raises(ValueError, match="softcap"):
        AttentionFeatures(softcap=-1.0)
    plan = build_plan(IDS, MASK, 3)
    q, k, v, _, _ = _inputs(plan, 4, 2, {})
    with pytest.raises(ValueError, match="one sink logit per query head"):
        attend(plan, "sdpa", q, k, v, 0.9, AttentionFeatures(sinks=torch.zeros(3, dtype=torch.float64)))


def _aten_ops():
    def fwd(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal, return_debug_mask, scale, window_size_left=None,
            window_size_right=None):
        w = None if window_size_left is None else window_of(window_size_left, window_size_right, causal)
        o, lse, _ = PRIMS.fwd(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, w)
        return o, lse, "rng", "unused", None

    def bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, causal, rng, unused, scale,
            window_size_left=None, window_size_right=None):
        w = None if window_size_left is None else window_of(window_size_left, window_size_right, causal)
        return PRIMS.bwd(dout, q, k, v, out, lse, None, cu_q, cu_k, max_q, max_k, scale, causal, w)

    import types

    return types.SimpleNamespace(aten=types.SimpleNamespace(_flash_attention_forward=fwd,
                                                            _flash_attention_backward=bwd))


@pytest.mark.parametrize("provider", ["flash_attn", "torch"])
def test_gpu_providers_pass_window_and_softcap_to_the_kernels(provider, monkeypatch):
    """The GPU adapters translate the contract's window / soft-cap into flash-attn's window_size=(W-1, 0|-1) and
    softcap, and ATen's window_size_left/right, checked with stand-ins that compute with the reference primitive:
    both flash designs through them equal the dense oracle. ATen's kernels have no soft-cap: refused by name."""
    from tests.attention.test_copyfree import fake_flash_attn
    from zorro_verl.attention import primitives

    if provider == "flash_attn":
        fake_flash_attn(monkeypatch)  # flash-attn 2.7's signatures, window_size_left/right and softcap read back
        prims = primitives._flash_attn_primitives()
    else:
        monkeypatch.setattr(primitives.torch, "ops", _aten_ops())
        prims = primitives._aten_primitives()
        monkeypatch.undo()
    plan = build_plan(IDS, MASK, 3)
    feats = [dict(window=3, sinks=True), dict(window=2)] + ([dict(softcap=0.6, window=4)] if provider == "flash_attn"
                                                            else [])
    for feat in feats:
        q, k, v, sinks, w = _inputs(plan, 4, 2, feat)
        f = AttentionFeatures(window=feat.get("window"), sinks=sinks, softcap=feat.get("softcap"))
        ref = dense_attention_oracle(plan, q, k, v, 0.9, window=f.window, sinks=sinks, softcap=f.softcap)
        leaves = (q, k, v) + ((sinks,) if sinks is not None else ())
        want = (ref, *torch.autograd.grad((ref * w).sum(), leaves))
        for fn in (attend_varlen, attend_copyfree):
            out = fn(plan, q, k, v, 0.9, f, prims=prims)
            for a, b in zip((out, *torch.autograd.grad((out * w).sum(), leaves)), want):
                assert (a - b).abs().max().item() <= TOL
    if provider == "torch":
        q, k, v, _, _ = _inputs(plan, 4, 2, {})
        with pytest.raises(ValueError, match="no soft-capping"):
            attend_copyfree(plan, q, k, v, 0.9, AttentionFeatures(softcap=1.0), prims=prims)


def test_window_index_gathers_only_the_prompt_tail_inside_the_window():
    """Hand example (prompts [0 1 2] and [6 7]; responses [3 4], [5] of the first, [8 9 10] of the second): a
    window W gathers the last min(p, W - 1) prompt tokens per response; the buffer bound Bnz * min(Pmax, W - 1) + N
    is filled from token 0 past the valid part."""
    from zorro_verl.attention.varlen import window_index

    plan = build_plan(IDS, MASK, 3)
    w2, w4 = window_index(plan, 2), window_index(plan, 4)
    assert w2["resp_kv_index"].tolist() == [2, 3, 4, 2, 5, 7, 8, 9, 10] and bool(w2["resp_kv_valid"].all())
    assert w2["cu_seqlens_k"].tolist() == [0, 3, 5, 9] and w2["max_seqlen_k"] == 1 + 3
    assert w4["resp_kv_index"].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 5, 6, 7, 8, 9, 10, 0]
    assert w4["resp_kv_valid"].tolist() == [True] * 14 + [False] and w4["cu_seqlens_k"].tolist() == [0, 5, 9, 14]
    assert window_index(plan, 1)["resp_kv_index"].tolist() == [3, 4, 5, 8, 9, 10]  # own tokens only


def test_rows_outside_every_segment_never_reach_the_gradients():
    """A kernel may leave the filler rows of the window buffer uninitialised in dk / dv: NaN there must not reach
    the keys' gradients (the gather's backward drops those rows)."""
    from zorro_verl.attention.primitives import VarlenPrimitives

    def bwd(dout, q, k, v, out, lse, state, cu_q, cu_k, *rest):
        dq, dk, dv = PRIMS.bwd(dout, q, k, v, out, lse, state, cu_q, cu_k, *rest)
        end = int(cu_k[-1])
        dk[end:], dv[end:] = float("nan"), float("nan")
        return dq, dk, dv

    prims = VarlenPrimitives("nan_filler", PRIMS.fwd, bwd)
    plan = build_plan(IDS, MASK, 3)
    q, k, v, sinks, w = _inputs(plan, 4, 2, dict(sinks=True))
    f = AttentionFeatures(window=4, sinks=sinks)
    ref = dense_attention_oracle(plan, q, k, v, 0.9, window=4, sinks=sinks)
    out = attend_varlen(plan, q, k, v, 0.9, f, prims=prims)
    for a, b in zip(torch.autograd.grad((out * w).sum(), (q, k, v, sinks)),
                    torch.autograd.grad((ref * w).sum(), (q, k, v, sinks))):
        assert (a - b).abs().max().item() <= TOL
