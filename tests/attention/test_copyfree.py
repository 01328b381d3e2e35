"""Copy-free (log-sum-exp merged) and gather varlen split attention, run on CPU in fp64 with the plain-torch varlen
primitives plugged in where flash-attn's go on GPU, and with PyTorch's CPU flash kernels (the copy-free backend's
own kernels on CPU): outputs and q/k/v gradients vs the dense-mask oracle and the reference backend, and a whole tiny
model's log-probs and parameter gradients vs the per-row oracle."""

import pytest
import torch
from hypothesis import given, settings

from tests.attention.test_backends import _qkv, dense_oracle
from tests.packing.test_plan import IDS, MASK, grpo_batches
from zorro_verl.attention import attend
from zorro_verl.attention.copyfree import attend_copyfree, copyfree_index, merge_attention
from zorro_verl.attention.primitives import cpu_flash_primitives, torch_primitives, varlen_attention
from zorro_verl.attention.varlen import attend_varlen
from zorro_verl.packing import build_plan

TOL = 1e-12  # fp64, same math up to summation order
PRIMS = torch_primitives()
CPU_FLASH = cpu_flash_primitives()
#: (design, kernels): both designs with the plain-torch reference kernels and with PyTorch's CPU flash kernels
VARIANTS = {"copyfree": (attend_copyfree, PRIMS), "gather": (attend_varlen, PRIMS),
            "copyfree_cpu_flash": (attend_copyfree, CPU_FLASH), "gather_cpu_flash": (attend_varlen, CPU_FLASH)}


def _outputs_and_grads(fn, plan, q, k, v, w):
    out = fn(plan, q, k, v, 0.3)
    return (out, *torch.autograd.grad((out * w).sum(), (q, k, v)))


def _compare(plan, variant, hq, hkv, d=8, seed=0):
    q, k, v = _qkv(plan, hq, hkv, d=d, seed=seed)
    w = torch.randn(1, plan.T, hq, d, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1))
    ref = _outputs_and_grads(dense_oracle, plan, q, k, v, w)
    fn, prims = VARIANTS[variant]
    got = _outputs_and_grads(lambda *a: fn(*a, prims=prims), plan, q, k, v, w)
    for name, a, b in zip(("out", "dq", "dk", "dv"), ref, got):
        assert a.shape == b.shape, name
        err = (a - b).abs().max().item()
        assert err <= TOL, f"{variant} {name}: max abs error {err:.3e} > {TOL}"
    return got


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (6, 1)])
def test_matches_dense_oracle(variant, hq, hkv):
    _compare(build_plan(IDS, MASK, 3), variant, hq, hkv)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_matches_reference_backend_on_grpo_batch(variant):
    from zorro_verl.testing import create_dummy_batch

    b = create_dummy_batch(7, 3, 9, 5, device="cpu", add_padding=True, shuffle=True, seed=3)
    plan = build_plan(b["input_ids"], b["attention_mask"], 5)
    got = _compare(plan, variant, 4, 2)
    q, k, v = _qkv(plan, 4, 2)
    w = torch.randn(1, plan.T, 4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ref = _outputs_and_grads(lambda *a: attend(a[0], "sdpa", *a[1:]), plan, q, k, v, w)  # the reference backend
    for a, c in zip(ref, got):
        assert (a - c).abs().max().item() <= TOL


@settings(max_examples=30, deadline=None)
@given(grpo_batches())
def test_over_random_structures(batch):
    """Any group structure: G = 1, G = B, unequal lengths, 0- and 1-token responses, interleaved siblings."""
    ids, mask, R = batch
    plan = build_plan(ids, mask, R)
    for variant in VARIANTS:
        _compare(plan, variant, 4, 2)


def test_group_without_response_tokens_uses_a_subset_of_prompts():
    # row 2 is the only row of its group and its response is empty: part A must skip that prompt
    ids = torch.tensor([[1, 2, 3, 7, 8], [1, 2, 3, 9, 0], [4, 5, 6, 0, 0], [0, 6, 5, 4, 4]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [0, 1, 1, 1, 1]])
    plan = build_plan(ids, mask, 2)
    ix = copyfree_index(plan)
    assert ix["ka_index"] is not None and ix["ka_index"].tolist() == [0, 1, 2, 6, 7]
    assert ix["cu_qa"].tolist() == [0, 3, 2 + 3]
    for variant in ("copyfree", "copyfree_cpu_flash"):
        _compare(plan, variant, 4, 2)


def test_all_responses_empty():
    ids = torch.tensor([[1, 2, 3, 0, 0], [1, 2, 3, 0, 0], [4, 5, 6, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 0, 0]])
    plan = build_plan(ids, mask, 2)
    assert plan.N == 0
    for variant in VARIANTS:
        _compare(plan, variant, 2, 1)


def test_merge_of_two_key_sets_is_attention_over_their_union():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(5, 2, 4, dtype=torch.float64, generator=g)
    k = torch.randn(9, 2, 4, dtype=torch.float64, generator=g)
    v = torch.randn(9, 2, 4, dtype=torch.float64, generator=g)
    cu5, cu4 = torch.tensor([0, 5], dtype=torch.int32), torch.tensor([0, 4], dtype=torch.int32)
    o_a, lse_a, _ = PRIMS.fwd(q, k[:4], v[:4], cu5, cu4, 5, 4, 0.5, False)
    o_b, lse_b, _ = PRIMS.fwd(q, k[4:], v[4:], cu5, cu5, 5, 5, 0.5, False)
    o, lse = merge_attention(o_a, lse_a, o_b, lse_b)
    o_ref, lse_ref, _ = PRIMS.fwd(q, k, v, cu5, torch.tensor([0, 9], dtype=torch.int32), 5, 9, 0.5, False)
    assert (o - o_ref).abs().max().item() <= TOL
    assert (lse - lse_ref).abs().max().item() <= TOL


def test_torch_primitives_match_sdpa_with_gqa_and_bottom_right_causal():
    """The plugged reference primitive itself: bottom-right causal (lk > lq) and GQA vs explicit SDPA."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(3, 4, 8, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(7, 2, 8, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(7, 2, 8, dtype=torch.float64, generator=g, requires_grad=True)
    cu_q, cu_k = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 7], dtype=torch.int32)
    out = varlen_attention(q, k, v, cu_q, cu_k, 3, 7, 0.4, True, PRIMS)
    allowed = torch.arange(7)[None, :] <= torch.arange(3)[:, None] + 4  # [3, 7]
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1).repeat_interleave(2, 0)[None],
        v.transpose(0, 1).repeat_interleave(2, 0)[None], attn_mask=allowed, scale=0.4)[0].transpose(0, 1)
    w = torch.randn_like(ref)
    for a, b in zip((out, *torch.autograd.grad((out * w).sum(), (q, k, v))),
                    (ref, *torch.autograd.grad((ref * w).sum(), (q, k, v)))):
        assert (a - b).abs().max().item() <= TOL


def test_cpu_flash_primitives_match_the_reference_primitives():
    """PyTorch's CPU flash kernels per segment vs the plain-torch primitives: out, lse and the backward under a
    given (merged-style, here perturbed) out / lse, causal and not, GQA, an empty segment; the calls the kernel
    cannot make (bottom-right causal with lk > lq, a window, a soft-cap) take the plain math."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(9, 4, 8, dtype=torch.float64, generator=g)
    k = torch.randn(9, 2, 8, dtype=torch.float64, generator=g)
    v = torch.randn(9, 2, 8, dtype=torch.float64, generator=g)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    calls = [(i32([0, 4, 4, 9]), i32([0, 4, 4, 9]), True, None, None),  # square causal segments, one empty
             (i32([0, 5, 9]), i32([0, 2, 9]), False, None, None),  # non-causal, unequal lengths
             (i32([0, 3, 9]), i32([0, 5, 9]), True, None, None),  # bottom-right causal (lk != lq): the plain math
             (i32([0, 9]), i32([0, 9]), True, 3, None), (i32([0, 9]), i32([0, 9]), True, None, 2.0)]
    for cu_q, cu_k, causal, window, cap in calls:
        args = (cu_q, cu_k, 9, 9, 0.35, causal, window, cap)
        o_ref, lse_ref, _ = PRIMS.fwd(q, k, v, *args)
        o, lse, st = CPU_FLASH.fwd(q, k, v, *args)
        # rows without a key (lk < lq, bottom-right causal): lse -inf in both
        assert (o - o_ref).abs().max().item() <= TOL
        assert torch.where(lse == lse_ref, 0.0, lse - lse_ref).abs().max().item() <= TOL
        dout = torch.randn(o.shape, dtype=o.dtype, generator=g)
        o_m, lse_m = o + 0.1 * torch.randn(o.shape, dtype=o.dtype, generator=g), lse + 0.2
        for a, b in zip(PRIMS.bwd(dout, q, k, v, o_m, lse_m, None, *args), CPU_FLASH.bwd(dout, q, k, v, o_m, lse_m,
                                                                                          st, *args)):
            assert (a - b).abs().max().item() <= TOL


def test_registered_backend_runs_on_cpu_with_the_cpu_flash_kernels():
    plan = build_plan(IDS, MASK, 3)
    q, k, v = _qkv(plan, 4, 2)
    w = torch.randn(1, plan.T, 4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ref = _outputs_and_grads(dense_oracle, plan, q, k, v, w)
    got = _outputs_and_grads(lambda *a: attend(a[0], "flash_copyfree", *a[1:]), plan, q, k, v, w)
    for a, b in zip(ref, got):
        assert (a - b).abs().max().item() <= TOL


@pytest.mark.parametrize("variant", ["flash_copyfree", "flash"])
def test_model_logprobs_and_grads_vs_per_row_oracle(variant, monkeypatch):
    """A whole tiny Qwen3 in fp64 through the registered attention: ``flash_copyfree`` with its CPU flash kernels,
    ``flash`` with the torch primitives plugged in."""
    import zorro_verl.attention.copyfree as cf
    from zorro_verl.attention import varlen
    from zorro_verl.integrations.transformers import install_zorro, zorro_step
    from zorro_verl.testing import create_dummy_batch, grads_of, max_rel_grad_error, ordinary_logprobs, tiny_model

    for mod in (varlen, cf):
        monkeypatch.setattr(mod, "flash_primitives", lambda: PRIMS)
        monkeypatch.setattr(mod, "check_flash_inputs", lambda name, q: None)

    model = tiny_model("qwen3", layers=2)
    b = create_dummy_batch(6, 2, 7, 4, device="cpu", add_padding=True, shuffle=True, seed=5, vocab_size=100)
    lp_ref, _ = ordinary_logprobs(model, b["input_ids"], b["attention_mask"], 4)
    lp_ref.sum().backward()
    g_ref = grads_of(model)
    model.zero_grad(set_to_none=True)
    install_zorro(model)
    plan = build_plan(b["input_ids"], b["attention_mask"], 4)
    lp, _ = zorro_step(model, plan, backend=variant)
    lp.sum().backward()
    assert (lp - lp_ref).abs().max().item() <= 1e-12
    err, name = max_rel_grad_error(g_ref, grads_of(model))
    assert err <= 1e-10, f"{name}: {err:.3e}"


def window_of(left, right, causal):
    """flash-attn's ``window_size`` back to the primitives' window; right must be 0 (causal) or -1 (unbounded)."""
    assert (left, right) == (-1, -1) or right == (0 if causal else -1), (left, right, causal)
    return None if left < 0 else left + 1


def _fa_fwd_26(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
               window_size, softcap, alibi_slopes, return_softmax, block_table, leftpad_k=None, seqused_k=None):
    o, lse, _ = PRIMS.fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                          window_of(*window_size, causal), softcap or None)
    return o, lse, None, "rng"


def _fa_bwd_26(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
               dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, rng_state=None):
    assert rng_state == "rng"
    for d, g in zip((dq, dk, dv), PRIMS.bwd(dout, q, k, v, out, softmax_lse, None, cu_seqlens_q, cu_seqlens_k,
                                          max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                                          window_of(*window_size, causal), softcap or None)):
        d.copy_(g)


def _fa_fwd_27(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
               window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None, return_softmax=False,
               block_table=None, leftpad_k=None, seqused_k=None, zero_tensors=False):
    return _fa_fwd_26(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                      causal, (window_size_left, window_size_right), softcap, alibi_slopes, return_softmax, None)


def _fa_bwd_27(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
               dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes,
               deterministic, rng_state=None, zero_tensors=False):
    _fa_bwd_26(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
               dropout_p, softmax_scale, causal, (window_size_left, window_size_right), softcap, alibi_slopes,
               deterministic, rng_state)


@pytest.mark.parametrize("fwd,bwd", [(_fa_fwd_26, _fa_bwd_26), (_fa_fwd_27, _fa_bwd_27)], ids=["fa2.6", "fa2.7"])
def test_flash_attn_adapter_builds_the_calls_of_each_version(fwd, bwd, monkeypatch):
    """The flash-attn 2 adapter (keyword names differ across 2.x) with stand-ins of those signatures that compute
    with the torch primitives: the copy-free attention through it equals the dense oracle."""
    from zorro_verl.attention import primitives

    fake_flash_attn(monkeypatch, bwd, fwd)
    prims = primitives._flash_attn_primitives()
    plan = build_plan(IDS, MASK, 3)
    q, k, v = _qkv(plan, 4, 2)
    w = torch.randn(1, plan.T, 4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ref = _outputs_and_grads(dense_oracle, plan, q, k, v, w)
    got = _outputs_and_grads(lambda *a: attend_copyfree(*a, prims=prims), plan, q, k, v, w)
    for a, b in zip(ref, got):
        assert (a - b).abs().max().item() <= TOL


def fake_flash_attn(monkeypatch, bwd=_fa_bwd_27, fwd=_fa_fwd_27):
    """flash_attn stand-ins (default: flash-attn 2.7 signatures, computing with the torch primitives)."""
    import sys
    import types

    fai = types.ModuleType("flash_attn.flash_attn_interface")
    fai._flash_attn_varlen_forward, fai._flash_attn_varlen_backward = fwd, bwd
    fa = types.ModuleType("flash_attn")
    fa.flash_attn_interface = fai
    monkeypatch.setitem(sys.modules, "flash_attn", fa)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", fai)


@pytest.mark.parametrize("env, want", [(None, False), ("0", False), ("1", True)])
def test_flash_attn_backward_honours_deterministic_env(env, want, monkeypatch):
    """``FLASH_ATTENTION_DETERMINISTIC=1`` (flash-attn's switch, set by verl's ``enable_full_determinism``) reaches
    flash-attn's varlen backward as ``deterministic=True``; it is read at the backward call, not at build time."""
    import functools

    from zorro_verl.attention import primitives

    seen = []

    @functools.wraps(_fa_bwd_27)  # the adapter reads the keyword names from the wrapped signature
    def bwd(*args, **kw):
        seen.append(kw["deterministic"])
        return _fa_bwd_27(*args, **kw)

    fake_flash_attn(monkeypatch, bwd)
    monkeypatch.delenv("FLASH_ATTENTION_DETERMINISTIC", raising=False)
    prims = primitives._flash_attn_primitives()
    if env is not None:
        monkeypatch.setenv("FLASH_ATTENTION_DETERMINISTIC", env)
    plan = build_plan(IDS, MASK, 3)
    q, k, v = _qkv(plan, 4, 2)
    w = torch.randn(1, plan.T, 4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    _outputs_and_grads(lambda *a: attend_copyfree(*a, prims=prims), plan, q, k, v, w)
    assert seen and all(d is want for d in seen)


@pytest.mark.parametrize("env, want", [(None, False), ("1", True)])
def test_aten_flash_backward_honours_deterministic_env(env, want, monkeypatch):
    """ATen's flash backward has no ``deterministic`` argument; it is deterministic only under
    ``torch.use_deterministic_algorithms(True, warn_only=False)``. With ``FLASH_ATTENTION_DETERMINISTIC=1`` that mode
    is on during the call (also when verl set ``warn_only=True``) and restored after it."""
    import types

    from zorro_verl.attention import primitives

    seen = []

    def fwd(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal, return_debug_mask, scale):
        o, lse, _ = PRIMS.fwd(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal)
        return o, lse, "rng", "unused", None  # lse [Hq, Tq], as the unpadded kernels return it

    def bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, causal, rng, unused, scale):
        seen.append((torch.are_deterministic_algorithms_enabled(),
                     torch.is_deterministic_algorithms_warn_only_enabled()))
        return PRIMS.bwd(dout, q, k, v, out, lse, None, cu_q, cu_k, max_q, max_k, scale, causal)

    fake_ops = types.SimpleNamespace(aten=types.SimpleNamespace(_flash_attention_forward=fwd,
                                                                _flash_attention_backward=bwd))
    monkeypatch.setattr(primitives.torch, "ops", fake_ops)
    prims = primitives._aten_primitives()
    monkeypatch.undo()  # torch.ops back; prims keeps the stand-ins
    if env is not None:
        monkeypatch.setenv("FLASH_ATTENTION_DETERMINISTIC", env)
    else:
        monkeypatch.delenv("FLASH_ATTENTION_DETERMINISTIC", raising=False)
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True, warn_only=True)  # what verl's enable_full_determinism sets
    try:
        plan = build_plan(IDS, MASK, 3)
        q, k, v = _qkv(plan, 4, 2)
        w = torch.randn(1, plan.T, 4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        ref = _outputs_and_grads(dense_oracle, plan, q, k, v, w)
        got = _outputs_and_grads(lambda *a: attend_copyfree(*a, prims=prims), plan, q, k, v, w)
        after = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    for a, b in zip(ref, got):
        assert (a - b).abs().max().item() <= TOL
    assert seen and all(s == ((True, False) if want else (True, True)) for s in seen)
    assert after == (True, True)  # verl's mode is restored after the backward
