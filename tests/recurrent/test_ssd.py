"""The Mamba-2 scan on the packed row (zorro_verl.recurrent.ssd): the chunked kernel vs the step-by-step definition,
and the packed scan (prompts once, responses from their prompt's final state; prefix trees down the trie) vs each
ordinary row run alone, values and gradients, fp64 — through zorro's torch kernel and through the fused-kernel adapter
(:func:`fused_ssd_kernel`) over the CPU stand-in of mamba-ssm's ``mamba_chunk_scan_combined``
(tests/support/mamba_ssm_cpu.py, itself checked here against the definition)."""

import functools

import pytest
import torch

from tests.recurrent.test_recurrent import _batch, _per_row_tokens
from tests.support import mamba_ssm_cpu
from zorro_verl.packing import build_plan
from zorro_verl.recurrent import (
    chunk_ssd,
    fused_ssd_kernel,
    packed_selective_scan,
    packed_ssd,
    recurrent_ssd_ref,
    selective_scan,
)
from zorro_verl.testing import batch_from_rows, shared_system_rows


def _rand_ssd_inputs(b, L, H, P, G, N, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)  # noqa: E731
    dt = torch.rand(b, L, H, generator=gen, dtype=dtype) * 0.5 + 0.05  # softplus output: > 0
    A = -torch.rand(H, generator=gen, dtype=dtype) * 2 - 0.1  # A < 0
    return r(b, L, H, P), dt, A, r(b, L, G, N), r(b, L, G, N), r(b, H, P, N)


@pytest.mark.parametrize("L,chunk,G", [(1, 64, 1), (37, 8, 2), (64, 16, 1), (70, 64, 2)])
def test_chunk_ssd_equals_recurrent_definition_fp64(L, chunk, G):
    x, dt, A, B, C, h0 = _rand_ssd_inputs(2, L, 4, 3, G, 5)
    y1, s1 = chunk_ssd(x, dt, A, B, C, initial_state=h0, output_final_state=True, chunk_size=chunk)
    y2, s2 = recurrent_ssd_ref(x, dt, A, B, C, initial_state=h0, output_final_state=True)
    assert y1.dtype == torch.float64 and y1.shape == (2, L, 4, 3) and s1.shape == (2, 4, 3, 5)
    assert (y1 - y2).abs().max().item() < 1e-13
    assert (s1 - s2).abs().max().item() < 1e-13
    y32, _ = chunk_ssd(*(t.float() for t in (x, dt, A, B, C)), chunk_size=chunk)
    assert y32.dtype == torch.float32  # fp32 in, fp32 out
    assert (y32.double() - chunk_ssd(x, dt, A, B, C, chunk_size=chunk)[0]).abs().max() < 1e-4


def test_zero_dt_pads_keep_the_state_fp64():
    """The padding rule the packed scan relies on: ``dt = x = B = C = 0`` tokens leave the state unchanged."""
    x, dt, A, B, C, h0 = _rand_ssd_inputs(1, 9, 2, 3, 1, 4, seed=2)
    _, s = chunk_ssd(x, dt, A, B, C, initial_state=h0, output_final_state=True, chunk_size=4)
    zeros = [torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, 5)) for t in (x, dt, B, C)]
    _, s_pad = chunk_ssd(zeros[0], zeros[1], A, zeros[2], zeros[3], initial_state=h0, output_final_state=True,
                         chunk_size=4)
    assert (s - s_pad).abs().max().item() < 1e-14


def _per_row_check(plan, seed, kernel=None):
    """Packed scan vs each ordinary row's uninterrupted scan (other chunk boundaries): values at every token, and
    gradients of a loss on response tokens only (the prompt's gradient then comes only through the states it hands
    down)."""
    H, P, G, N = 4, 3, 2, 5
    x, dt, A, B, C, _ = _rand_ssd_inputs(1, plan.T, H, P, G, N, seed=seed)
    leaves = [t[0].clone().requires_grad_() for t in (x, dt, B, C)] + [A.clone().requires_grad_()]
    xs, dts, Bs, Cs, As = leaves
    kernel = kernel or functools.partial(chunk_ssd, chunk_size=4)
    y = packed_ssd(kernel, xs, dts, As, Bs, Cs, plan)  # [T, H, P]
    idx, valid = _per_row_tokens(plan)
    rows = [t[idx] * valid.view(*valid.shape, *([1] * (t.dim() - 1))) for t in (xs, dts, Bs, Cs)]
    y_row, _ = chunk_ssd(rows[0], rows[1], As, rows[2], rows[3], chunk_size=5)  # [B, Lmax, H, P]
    resp = valid & (torch.arange(idx.shape[1])[None, :] >= plan.row_prompt_lens[:, None])
    assert y.shape == (plan.T, H, P)
    assert (y[idx[valid]] - y_row[valid]).abs().max().item() < 1e-13
    w = torch.randn(int(resp.sum()), H, P, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    ga = torch.autograd.grad((y[idx[resp]] * w).sum(), leaves)
    gr = torch.autograd.grad((y_row[resp] * w).sum(), leaves)
    for a, r in zip(ga, gr):
        assert r.abs().max().item() > 0.1
        assert (a - r).abs().max().item() < 1e-11 * max(1.0, r.abs().max().item())
    return y


def test_packed_ssd_equals_per_row_fp64():
    batch = _batch()
    plan = build_plan(batch["input_ids"], batch["attention_mask"], 6)
    assert plan.T < plan.ordinary_tokens
    _per_row_check(plan, seed=5)


def test_packed_ssd_prefix_tree_equals_per_row_fp64():
    """sharing='prefix': a shared system prompt over two questions, and a branching rollout: the state runs down the
    trie from each node's parent's final state."""
    from tests.attention.test_tree_backends import branching_rows

    rows = shared_system_rows(2, 2, system_len=9, question_len=2, response_len=5, vocab_size=100, seed=5)
    rows += branching_rows(depth=3, width=2, turn=2, seed=6)
    batch = batch_from_rows(rows)
    plan = build_plan(batch["input_ids"], batch["attention_mask"], batch["responses"].shape[1], sharing="prefix",
                      min_shared_len=1)
    assert plan.tree.levels == 4
    _per_row_check(plan, seed=7)


@pytest.mark.parametrize("L,G", [(1, 1), (23, 2)])
def test_mamba_ssm_standin_equals_recurrent_definition_fp64(L, G):
    """The CPU stand-in of mamba-ssm's fused scan computes the definition: from an initial state, with its final
    state; and with the kernel's own dt_bias / softplus / dt_limit / D applied as the kernel documents them."""
    x, dt, A, B, C, h0 = _rand_ssd_inputs(2, L, 4, 3, G, 5, seed=3)
    y, s = mamba_ssm_cpu.mamba_chunk_scan_combined(x, dt, A, B, C, 8, initial_states=h0, return_final_states=True)
    y_ref, s_ref = recurrent_ssd_ref(x, dt, A, B, C, initial_state=h0, output_final_state=True)
    assert y.dtype == torch.float64 and (y - y_ref).abs().max().item() < 1e-13
    assert (s - s_ref).abs().max().item() < 1e-13
    bias, D = torch.linspace(-0.5, 0.5, 4, dtype=torch.float64), torch.linspace(0.5, 1.5, 4, dtype=torch.float64)
    y2 = mamba_ssm_cpu.mamba_chunk_scan_combined(x, dt, A, B, C, 8, D=D, dt_bias=bias, dt_softplus=True,
                                                 dt_limit=(0.2, 0.9))
    dt2 = torch.nn.functional.softplus(dt + bias).clamp(0.2, 0.9)
    y2_ref = recurrent_ssd_ref(x, dt2, A, B, C)[0] + D[:, None] * x
    assert (y2 - y2_ref).abs().max().item() < 1e-13
    y16 = mamba_ssm_cpu.mamba_chunk_scan_combined(*(t.bfloat16() for t in (x, dt, A, B, C)), 8)
    assert y16.dtype == torch.bfloat16  # the output in x's dtype, as the kernel's


def test_packed_ssd_through_the_fused_kernel_fp64():
    """The packed scan through :func:`fused_ssd_kernel` (mamba-ssm's contract, the CPU stand-in) equals each ordinary
    row run alone, values and gradients (through the responses' initial states back into the prompts), for prompt
    sharing and a prefix tree; the prompts run once with their final states, the responses from them."""
    from tests.attention.test_tree_backends import branching_rows

    kernel = fused_ssd_kernel(mamba_ssm_cpu.mamba_chunk_scan_combined, 4)
    batch = _batch()
    mamba_ssm_cpu.CALLS.clear()
    y = _per_row_check(build_plan(batch["input_ids"], batch["attention_mask"], 6), seed=5, kernel=kernel)
    calls = mamba_ssm_cpu.CALLS[:2]  # the forward's two calls (the rest: the per-row reference's)
    assert [(c["initial_states"], c["final"]) for c in calls] == [(False, True), (True, False)]
    assert calls[1]["batch"] == batch["input_ids"].shape[0] and y.dtype == torch.float64
    rows = shared_system_rows(2, 2, system_len=9, question_len=2, response_len=5, vocab_size=100, seed=5)
    rows += branching_rows(depth=3, width=2, turn=2, seed=6)
    batch = batch_from_rows(rows)
    plan = build_plan(batch["input_ids"], batch["attention_mask"], batch["responses"].shape[1], sharing="prefix",
                      min_shared_len=1)
    _per_row_check(plan, seed=7, kernel=kernel)


# ---------------------------------------------------------------------------------------------------- Mamba v1
def _rand_v1_inputs(b, L, D, N, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    dt = torch.rand(b, L, D, generator=gen, dtype=torch.float64) * 0.5 + 0.05
    A = -torch.rand(D, N, generator=gen, dtype=torch.float64) * 2 - 0.1
    return r(b, L, D), dt, A, r(b, L, N), r(b, L, N)


def test_selective_scan_matches_transformers_mamba_recurrence_fp64():
    """transformers' Mamba slow path written as its per-element decay (its formula, summed the same way): the scan
    and its carried state (a row split in two equals the row whole)."""
    x, dt, A, B, C = _rand_v1_inputs(2, 13, 6, 4)
    y, s = selective_scan(x, dt, A, B, C, output_final_state=True)
    dA = torch.exp(A[None, :, None, :] * dt.transpose(1, 2)[..., None])  # [b, D, L, N] as transformers builds it
    dBu = dt.transpose(1, 2)[..., None] * B[:, None] * x.transpose(1, 2)[..., None]
    S = torch.zeros(2, 6, 4, dtype=torch.float64)
    ref = []
    for i in range(13):
        S = dA[:, :, i] * S + dBu[:, :, i]
        ref.append(torch.matmul(S, C[:, i, :, None])[..., 0])
    assert (y - torch.stack(ref, 1)).abs().max().item() < 1e-14 and (s - S).abs().max().item() < 1e-14
    y1, s1 = selective_scan(*(t[:, :5] for t in (x, dt)), A, *(t[:, :5] for t in (B, C)), output_final_state=True)
    y2, _ = selective_scan(*(t[:, 5:] for t in (x, dt)), A, *(t[:, 5:] for t in (B, C)), initial_state=s1)
    assert (torch.cat([y1, y2], 1) - y).abs().max().item() < 1e-14


@pytest.mark.parametrize("tree", [False, True])
def test_packed_selective_scan_equals_per_row_fp64(tree):
    if tree:
        from tests.attention.test_tree_backends import branching_rows

        rows = shared_system_rows(2, 2, system_len=9, question_len=2, response_len=5, vocab_size=100, seed=5)
        batch = batch_from_rows(rows + branching_rows(depth=3, width=2, turn=2, seed=6))
        plan = build_plan(batch["input_ids"], batch["attention_mask"], batch["responses"].shape[1],
                          sharing="prefix", min_shared_len=1)
    else:
        batch = _batch()
        plan = build_plan(batch["input_ids"], batch["attention_mask"], 6)
    x, dt, A, B, C = _rand_v1_inputs(1, plan.T, 5, 3, seed=9)
    leaves = [t[0].clone().requires_grad_() for t in (x, dt, B, C)] + [A.clone().requires_grad_()]
    xs, dts, Bs, Cs, As = leaves
    y = packed_selective_scan(xs, dts, As, Bs, Cs, plan)  # [T, D]
    idx, valid = _per_row_tokens(plan)
    rows = [t[idx] * valid.view(*valid.shape, *([1] * (t.dim() - 1))) for t in (xs, dts, Bs, Cs)]
    y_row, _ = selective_scan(rows[0], rows[1], As, rows[2], rows[3])  # [B, Lmax, D]
    resp = valid & (torch.arange(idx.shape[1])[None, :] >= plan.row_prompt_lens[:, None])
    assert (y[idx[valid]] - y_row[valid]).abs().max().item() < 1e-13
    w = torch.randn(int(resp.sum()), 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ga = torch.autograd.grad((y[idx[resp]] * w).sum(), leaves)
    gr = torch.autograd.grad((y_row[resp] * w).sum(), leaves)
    for a, r in zip(ga, gr):
        assert r.abs().max().item() > 0.1
        assert (a - r).abs().max().item() < 1e-11 * max(1.0, r.abs().max().item())
