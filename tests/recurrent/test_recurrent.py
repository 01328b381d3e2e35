"""Recurrent layers on the packed row (zorro_verl.recurrent): the reference gated delta rule, the packed causal conv
and the packed delta rule vs per-row computation, fp64."""

import functools

import pytest
import torch

from zorro_verl.packing import build_plan
from zorro_verl.recurrent import (
    chunk_gated_delta_rule_ref,
    packed_causal_conv,
    packed_gated_delta_rule,
    recurrent_gated_delta_rule_ref,
)
from zorro_verl.testing import create_dummy_batch


def _rand_rule_inputs(b, L, H, Dk, Dv, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)  # noqa: E731
    g = -torch.rand(b, L, H, generator=gen, dtype=dtype) * 2  # log decay <= 0
    beta = torch.rand(b, L, H, generator=gen, dtype=dtype)
    return r(b, L, H, Dk), r(b, L, H, Dk), r(b, L, H, Dv), g, beta, r(b, H, Dk, Dv)


# ---------------------------------------------------------------------------------------------------- kernels
@pytest.mark.parametrize("L,chunk", [(1, 64), (37, 8), (64, 16), (70, 64)])
def test_chunk_ref_equals_recurrent_definition_fp64(L, chunk):
    q, k, v, g, beta, h0 = _rand_rule_inputs(2, L, 3, 8, 5)
    o1, s1 = chunk_gated_delta_rule_ref(q, k, v, g, beta, chunk_size=chunk, initial_state=h0, output_final_state=True,
                                        use_qk_l2norm_in_kernel=True)
    o2, s2 = recurrent_gated_delta_rule_ref(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                            use_qk_l2norm_in_kernel=True)
    assert o1.dtype == torch.float64 and o1.shape == (2, L, 3, 5) and s1.shape == (2, 3, 8, 5)
    assert (o1 - o2).abs().max().item() < 1e-13
    assert (s1 - s2).abs().max().item() < 1e-13


def test_chunk_ref_matches_transformers_fallback_fp32():
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    q, k, v, g, beta, h0 = _rand_rule_inputs(2, 45, 3, 8, 5, seed=1)
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o64, s64 = chunk_gated_delta_rule_ref(q, k, v, g, beta, chunk_size=16, **kw)  # fp64: the truth here
    args32 = [x.float() for x in (q, k, v, g, beta)]
    kw32 = dict(kw, initial_state=h0.float())
    o_c, s_c = torch_chunk_gated_delta_rule(*args32, chunk_size=16, **kw32)
    o_r, s_r = torch_recurrent_gated_delta_rule(*args32, **kw32)
    # transformers' two fp32 formulations disagree by their own rounding; their chunked one must sit within 2x of
    # that from our fp64 result (our kernel computes the same function).
    ref_err = max((o_c - o_r).abs().max().item(), (s_c - s_r).abs().max().item())
    assert 0 < ref_err < 1e-5
    assert (o_c.double() - o64).abs().max().item() <= 2 * ref_err
    assert (s_c.double() - s64).abs().max().item() <= 2 * ref_err
    o32, _ = chunk_gated_delta_rule_ref(*args32, chunk_size=16, **kw32)
    assert o32.dtype == torch.float32  # fp32 in, fp32 out (compute dtype fp32)


# ---------------------------------------------------------------------------------------------------- packed ops
def _batch(B=7, G=3, P=9, R=6, seed=3):
    return create_dummy_batch(batch_size=B, num_unique_prompts=G, prompt_len=P, response_len=R, device="cpu",
                              add_padding=True, vocab_size=128, seed=seed, shuffle=True)


def _per_row_tokens(plan):
    """``[B, Lmax]`` packed index of each ordinary row's tokens (prompt then response) and its validity mask."""
    fi = plan.full_index()  # [B, S], left-padded prompt + right-padded response, -1 on pads
    valid = fi >= 0
    # left-align each row's valid tokens: stable sort puts the valid ones first, in order
    order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices
    idx, valid = fi.gather(1, order), valid.gather(1, order)
    Lmax = plan.max_row_len
    return torch.where(valid, idx, 0)[:, :Lmax], valid[:, :Lmax]


@pytest.mark.parametrize("P,Kc", [(9, 4), (2, 4), (1, 3)])
def test_packed_causal_conv_equals_per_row_conv(P, Kc):
    batch = _batch(P=P)
    plan = build_plan(batch["input_ids"], batch["attention_mask"], 6)
    C = 5
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(plan.T, C, generator=gen, dtype=torch.float64)
    w = torch.randn(C, Kc, generator=gen, dtype=torch.float64)
    bias = torch.randn(C, generator=gen, dtype=torch.float64)
    idx, valid = _per_row_tokens(plan)
    rows = x[idx] * valid[..., None]  # [B, Lmax, C] right padded: the causal conv never sees the pad
    ref = torch.nn.functional.conv1d(rows.transpose(1, 2), w[:, None], bias, padding=Kc - 1, groups=C)
    ref = ref[:, :, : idx.shape[1]].transpose(1, 2)  # [B, Lmax, C]
    out = packed_causal_conv(x, w, bias, plan)  # [T, C]
    assert (out[idx[valid]] - ref[valid]).abs().max().item() < 1e-14
    act = packed_causal_conv(x, w, bias, plan, activation="silu")
    assert (act - torch.nn.functional.silu(out)).abs().max().item() == 0
    # causal-conv1d's contract (x [1, C, L] channel-last, weight [C, Kc], zero left padding, fused activation), by
    # torch on CPU: exercises the GPU index path.
    def fake_kernel(x, weight, bias, activation):
        L = x.shape[-1]
        y = torch.nn.functional.conv1d(x, weight[:, None], bias, padding=Kc - 1, groups=C)[..., :L]
        return torch.nn.functional.silu(y) if activation else y

    via_kernel = packed_causal_conv(x, w, bias, plan, activation="silu", causal_conv1d_fn=fake_kernel)
    assert (via_kernel - act).abs().max().item() < 1e-14


def _varlen_ref_kernel(q, k, v, g, beta, initial_state=None, output_final_state=False, cu_seqlens=None, **kw):
    """flash-linear-attention's varlen contract (batch 1, ``cu_seqlens``, one state per sequence) on CPU, by a
    per-sequence loop over the reference kernel (test only): exercises zorro's GPU index path."""
    cu = cu_seqlens.tolist()
    outs, finals = [], []
    for i in range(len(cu) - 1):
        sl = slice(cu[i], cu[i + 1])
        h0 = None if initial_state is None else initial_state[i: i + 1]
        o, s = chunk_gated_delta_rule_ref(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], chunk_size=4,
                                          initial_state=h0, output_final_state=True, **kw)
        outs.append(o)
        finals.append(s)
    return torch.cat(outs, 1), (torch.cat(finals) if output_final_state else None)


def test_packed_delta_rule_equals_per_row_and_varlen_path():
    batch = _batch()
    plan = build_plan(batch["input_ids"], batch["attention_mask"], 6)
    H, Dk, Dv = 2, 4, 3
    q, k, v, g, beta, _ = _rand_rule_inputs(1, plan.T, H, Dk, Dv, seed=5)
    leaves = [x[0].clone().requires_grad_() for x in (q, k, v, g, beta)]  # [T, ...] packed row
    kern = functools.partial(chunk_gated_delta_rule_ref, chunk_size=4)
    o_pad = packed_gated_delta_rule(kern, *leaves, plan)
    o_var = packed_gated_delta_rule(_varlen_ref_kernel, *leaves, plan, varlen=True)
    # Ordinary rows: each row's [prompt | response] in one uninterrupted pass (other chunk boundaries).
    idx, valid = _per_row_tokens(plan)
    rows = [x[idx] * valid.view(*valid.shape, *([1] * (x.dim() - 1))) for x in leaves]
    o_row, _ = chunk_gated_delta_rule_ref(*rows, chunk_size=5, use_qk_l2norm_in_kernel=True)  # [B, Lmax, H, Dv]
    resp = valid & (torch.arange(idx.shape[1])[None, :] >= plan.row_prompt_lens[:, None])
    assert o_pad.shape == (plan.T, H, Dv)
    assert (o_pad[idx[resp]] - o_row[resp]).abs().max().item() < 1e-13
    assert (o_pad[idx[valid]] - o_row[valid]).abs().max().item() < 1e-13
    assert (o_var - o_pad).abs().max().item() < 1e-13
    # A loss on response tokens only: the prompt's gradient then comes only through the states it hands over.
    w = torch.randn(int(resp.sum()), H, Dv, dtype=torch.float64)
    ga = torch.autograd.grad((o_pad[idx[resp]] * w).sum(), leaves)
    gb = torch.autograd.grad((o_var[idx[resp]] * w).sum(), leaves)
    gr = torch.autograd.grad((o_row[resp] * w).sum(), leaves)
    for a, b, c in zip(ga, gb, gr):
        assert c.abs().max().item() > 0.1
        assert (a - b).abs().max().item() < 1e-12
        assert (a - c).abs().max().item() < 1e-12  # prompt gradients: the sum over every response's use
