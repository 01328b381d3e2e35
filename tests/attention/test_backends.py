"""Attention backends vs a dense-mask oracle on the packed row (fp64): outputs and q/k/v gradients."""

import pytest
import torch
from hypothesis import given, settings

from tests.packing.test_plan import grpo_batches
from zorro_verl.attention import BACKEND_NAMES, BACKENDS, attend, available_backends, flash_available, get_backend
from zorro_verl.attention.varlen import varlen_index
from zorro_verl.packing import build_plan
from zorro_verl.testing import dense_attention_oracle

TOL = 1e-12  # fp64: both sides are the same math up to summation order


def dense_oracle(plan, q, k, v, scaling):
    """softmax(q k^T * s + mask) v over the whole packed row with the dense [T, T] mask — O(T^2), tests only."""
    return dense_attention_oracle(plan, q, k, v, scaling)


def _qkv(plan, hq, hkv, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h: torch.randn(1, h, plan.T, d, generator=g, dtype=torch.float64, requires_grad=True)  # noqa: E731
    return mk(hq), mk(hkv), mk(hkv)


def _check(plan, backend, hq, hkv, grads=True):
    q, k, v = _qkv(plan, hq, hkv)
    if not grads:
        q, k, v = q.detach(), k.detach(), v.detach()
    ref = dense_oracle(plan, q, k, v, 0.3)
    out = attend(plan, backend, q, k, v, 0.3)
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
    from tests.packing.test_plan import IDS, MASK

    _check(build_plan(IDS, MASK, 3), backend, hq, hkv)


@settings(max_examples=40, deadline=None)
@given(grpo_batches())
def test_reference_backends_over_random_structures(batch):
    ids, mask, R = batch
    for backend in ("sdpa", "eager", "standard"):
        _check(build_plan(ids, mask, R), backend, 4, 2)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2)])
def test_flex_forward_matches_dense_oracle(hq, hkv):
    from tests.packing.test_plan import IDS, MASK

    _check(build_plan(IDS, MASK, 3), "flex", hq, hkv, grads=False)


def test_flex_refuses_cpu_backward():
    from tests.packing.test_plan import IDS, MASK

    plan = build_plan(IDS, MASK, 3)
    q, k, v = _qkv(plan, 4, 2)
    with pytest.raises(ValueError, match="no backward on CPU"):
        attend(plan, "flex", q, k, v, 0.3)


def test_flash_backend_refuses_cpu():
    """``flash`` (the gather design) is CUDA-only; ``flash_copyfree`` runs on CPU (test_copyfree.py)."""
    from tests.packing.test_plan import IDS, MASK

    plan = build_plan(IDS, MASK, 3)
    q, k, v = _qkv(plan, 4, 2)
    with pytest.raises(ValueError, match="fp16/bf16 CUDA"):
        attend(plan, "flash", q, k, v, 0.3)


def test_flash_missing_names_the_extra(monkeypatch):
    import sys

    from zorro_verl.attention import primitives

    monkeypatch.delenv("ZORRO_FLASH_PROVIDER", raising=False)
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setattr(primitives.torch.cuda, "is_available", lambda: False)
    assert primitives.flash_provider() is None and not flash_available("cuda")
    with pytest.raises(ImportError, match=r"zorro-verl\[flash\]"):
        primitives.flash_primitives()


def test_registry_names_availability_and_errors():
    assert BACKEND_NAMES == ("sdpa", "eager", "standard", "flash", "flash_copyfree", "flex")
    for name, b in BACKENDS.items():
        assert b.name == name and callable(b.attend) and callable(b.index) and b.summary
    # this CPU host: the pure-torch backends and the copy-free one (PyTorch's CPU flash kernels) run forward and
    # backward; flash needs CUDA, flex has no CPU backward
    assert available_backends("cpu") == ["sdpa", "eager", "standard", "flash_copyfree"]
    assert not flash_available("cpu")
    with pytest.raises(ValueError, match="expected one of"):
        get_backend("flash_attention_2")
    with pytest.raises(ValueError, match="expected one of"):
        attend(build_plan(torch.tensor([[1, 2, 3]]), None, 1), "nope", *_qkv(build_plan(torch.tensor([[1, 2, 3]]),
                                                                                          None, 1), 2, 2), 0.3)


def test_each_backend_owns_its_index_set():
    from tests.packing.test_plan import IDS, MASK

    plan = build_plan(IDS, MASK, 3)
    built = {name: BACKENDS[name].index(plan) for name in ("sdpa", "standard", "flash", "flash_copyfree")}
    # memoised per backend (sdpa and eager share the reference set), built once per plan
    assert BACKENDS["eager"].index(plan) is built["sdpa"]
    for name, idx in built.items():
        assert BACKENDS[name].index(plan) is idx
    assert built["standard"] is not built["sdpa"] and built["flash"] is not built["flash_copyfree"]


def test_varlen_index_hand_example():
    from tests.packing.test_plan import IDS, MASK

    v = varlen_index(build_plan(IDS, MASK, 3))
    assert v["prompt_token_index"].tolist() == [0, 1, 2, 6, 7]
    assert v["cu_seqlens_prompt"].tolist() == [0, 3, 5] and v["cu_seqlens_prompt"].dtype == torch.int32
    assert v["resp_q_index"].tolist() == [3, 4, 5, 8, 9, 10]
    assert v["cu_seqlens_q"].tolist() == [0, 2, 3, 6]  # empty row 2 left out
    assert v["resp_kv_index"].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 5, 6, 7, 8, 9, 10]
    assert v["cu_seqlens_k"].tolist() == [0, 5, 9, 14]
