"""Attention backends vs a dense-mask oracle on the packed row (fp64): outputs and q/k/v gradients."""

import pytest
import torch
from hypothesis import given, settings

from tests.test_plan import grpo_batches
from zorro_verl.attention import attend
from zorro_verl.packing import build_plan

TOL = 1e-12  # fp64: both sides are the same math up to summation order


def dense_oracle(plan, q, k, v, scaling):
    """softmax(q k^T * s + mask) v over the whole packed row, mask = plan.dense_mask() — O(T^2), tests only."""
    hq, hkv = q.shape[1], k.shape[1]
    k = k.repeat_interleave(hq // hkv, 1)
    v = v.repeat_interleave(hq // hkv, 1)
    s = (q @ k.transpose(-1, -2)) * scaling
    s = s.masked_fill(~plan.dense_mask(), float("-inf"))
    return (torch.softmax(s, -1) @ v).transpose(1, 2)  # [1, T, Hq, D]


def _qkv(plan, hq, hkv, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h: torch.randn(1, h, plan.T, d, generator=g, dtype=torch.float64, requires_grad=True)  # noqa: E731
    return mk(hq), mk(hkv), mk(hkv)


def _check(plan, hq, hkv, grads=True):
    q, k, v = _qkv(plan, hq, hkv)
    if not grads:
        q, k, v = q.detach(), k.detach(), v.detach()
    ref = dense_oracle(plan, q, k, v, 0.3)
    out = attend(plan, q, k, v, 0.3)
    assert out.shape == (1, plan.T, hq, q.shape[-1])
    assert (out - ref).abs().max().item() <= TOL
    if grads:
        w = torch.randn_like(ref)
        g_ref = torch.autograd.grad((ref * w).sum(), (q, k, v))
        g_out = torch.autograd.grad((out * w).sum(), (q, k, v))
        for a, b in zip(g_ref, g_out):
            assert (a - b).abs().max().item() <= TOL


@pytest.mark.parametrize("backend", ["sdpa", "eager", "standard"])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (6, 1)])
def test_backends_match_dense_oracle(backend, hq, hkv):
    from tests.test_plan import IDS, MASK

    _check(build_plan(IDS, MASK, 3, backend=backend), hq, hkv)


@settings(max_examples=40, deadline=None)
@given(grpo_batches())
def test_reference_backends_over_random_structures(batch):
    ids, mask, R = batch
    for backend in ("sdpa", "eager", "standard"):
        _check(build_plan(ids, mask, R, backend=backend), 4, 2)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2)])
def test_flex_forward_matches_dense_oracle(hq, hkv):
    from tests.test_plan import IDS, MASK

    _check(build_plan(IDS, MASK, 3, backend="flex"), hq, hkv, grads=False)


def test_flex_refuses_cpu_backward():
    from tests.test_plan import IDS, MASK

    plan = build_plan(IDS, MASK, 3, backend="flex")
    q, k, v = _qkv(plan, 4, 2)
    with pytest.raises(ValueError, match="no backward on CPU"):
        attend(plan, q, k, v, 0.3)


def test_flash_backend_refuses_cpu():
    from tests.test_plan import IDS, MASK

    plan = build_plan(IDS, MASK, 3, backend="flash")
    q, k, v = _qkv(plan, 4, 2)
    with pytest.raises(ValueError, match="fp16/bf16 CUDA"):
        attend(plan, q, k, v, 0.3)


def test_flash_missing_names_the_extra(monkeypatch):
    import sys

    from zorro_verl.attention import varlen

    monkeypatch.setattr(varlen, "_FLASH_FN", None)
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)
    with pytest.raises(ImportError, match=r"zorro-verl\[flash\]"):
        varlen.load_flash_varlen()
