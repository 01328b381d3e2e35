"""Backend ``flash_copyfree``: varlen split attention without a per-response copy of the prompt's K/V
(docs/DESIGN.md §2).

Three varlen calls over the packed row's tokens, permuted (O(T) copies) but never duplicated::

    prompts     q/k/v[prompt tokens]                 segments: each unique prompt            causal
    part A      q[response tokens] vs k/v[prompts]   segments: all responses of group g | prompt g   non-causal
    part B      q/k/v[response tokens]               segments: each response                 causal

A response token's attention is the softmax over (its prompt's keys) U (its own prefix): parts A and B are merged
by log-sum-exp, ``lse = logaddexp(lse_a, lse_b)``, ``o = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b``.
Backward is exact without differentiating through ``lse``: each part's kernel backward is called with the
**merged** ``o`` and ``lse`` (it recomputes ``P = exp(S - lse)``, the merged probabilities restricted to its keys,
and ``rowsum(dO * o)``), and the parts' ``dq`` are summed — the ring-attention trick.

**Sliding-window layers.** A flash kernel's window is one band per call, relative to each segment's bottom-right
corner. Part A's query segment holds *all* responses of a group against one key segment (the prompt), so a query's
distance to the prompt is not its distance to the segment's corner and no band expresses ``pos_q - pos_k < W``
there; a segment per response would need the prompt's keys once per response. A layer whose window cuts inside the
plan therefore runs ``flash``'s windowed response call (per response ``[its prompt's window tail ; itself]``,
:func:`~zorro_verl.attention.varlen.window_index`: at most ``W - 1`` prompt keys per response are gathered, the
prompt blocks entirely outside the window never); a window at least as long as every row is dropped, so those
layers stay copy-free.

The kernels are pluggable :class:`~zorro_verl.attention.primitives.VarlenPrimitives`: flash kernels on GPU, the plain
torch reference (:func:`~zorro_verl.attention.primitives.torch_primitives`) in the CPU fp64 tests.
"""

from __future__ import annotations

from typing import Optional

import torch

from zorro_verl.attention.base import Backend
from zorro_verl.attention.features import NO_FEATURES, AttentionFeatures, add_sink, sink_grad
from zorro_verl.attention.primitives import (
    VarlenPrimitives,
    check_flash_inputs,
    flash_available,
    flash_primitives,
)
from zorro_verl.attention.varlen import attend_varlen, varlen_index
from zorro_verl.packing import ZorroPlan
from zorro_verl.packing.segments import cu_seqlens, excl_cumsum, segments_to_tokens

__all__ = ["BACKEND", "attend_copyfree", "copyfree_index", "merge_attention"]



def copyfree_index(plan: ZorroPlan) -> dict:
    """Index set of the copy-free backend (memoised in the plan under ``"flash_copyfree"``; its sizes come from
    the plan: no host sync).

    * ``prompt_tokens [Np]``, ``cu_p [G+1] int32``, ``max_p``: the prompt call;
    * ``resp_tokens [N]`` (packed order: group-major, rows in order), ``cu_r [Bnz+1] int32``, ``max_r``: part B;
    * part A: ``cu_qa [Ga+1] int32`` (response tokens of each group that has any), ``cu_ka [Ga+1] int32`` (its
      prompt), ``max_qa``, ``max_ka``, and ``ka_index [Np_a]`` into ``prompt_tokens`` order — None when every
      group has a response token (then part A reads the prompt call's K/V as they are).
    """

    def build():
        v = varlen_index(plan)  # the prompt call and part B are the gather design's calls
        dev = plan.device
        per_group = torch.zeros(plan.G, dtype=torch.long, device=dev).index_add_(0, plan.row_group,
                                                                                   plan.response_lens)  # [G]
        has = per_group > 0
        n_ga, max_qa, max_ka, np_a = plan.group_counts
        ga = torch.argsort((~has).to(torch.int8), stable=True)[:n_ga]  # [Ga] groups with responses, in order
        ka_index = None
        if n_ga < plan.G:
            starts = excl_cumsum(plan.prompt_lens)[ga]  # offsets in prompt-token order
            ka_index = segments_to_tokens(starts, plan.prompt_lens[ga], np_a)
        return {
            "prompt_tokens": v["prompt_token_index"], "cu_p": v["cu_seqlens_prompt"], "max_p": v["max_seqlen_prompt"],
            "resp_tokens": v["resp_q_index"], "cu_r": v["cu_seqlens_q"], "max_r": v["max_seqlen_q"],
            "cu_qa": cu_seqlens(per_group[ga]), "cu_ka": cu_seqlens(plan.prompt_lens[ga]),
            "max_qa": max_qa, "max_ka": max_ka,
            "ka_index": ka_index,
        }

    return plan.memo.get("flash_copyfree", build)


def merge_attention(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor):
    """Merge two partial attentions over disjoint key sets. ``o_* [Tq, Hq, D]``, ``lse_* [Hq, Tq]`` fp32/fp64 ->
    ``(o [Tq, Hq, D] in o_a's dtype, lse [Hq, Tq])``; the weights are taken in the lse dtype."""
    lse = torch.logaddexp(lse_a, lse_b)  # [Hq, Tq]
    w_a = torch.exp(lse_a - lse).transpose(0, 1)[..., None]  # [Tq, Hq, 1]
    w_b = torch.exp(lse_b - lse).transpose(0, 1)[..., None]
    o = w_a * o_a.to(lse.dtype) + w_b * o_b.to(lse.dtype)
    return o.to(o_a.dtype), lse


class _CopyFreeAttention(torch.autograd.Function):
    """``q [T, Hq, D], k/v [T, Hkv, D]`` (packed row) -> ``out [T, Hq, D]`` with the exact merged backward."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, ix: dict, N: int, scale: float, softcap, prims: VarlenPrimitives):
        pt, rt = ix["prompt_tokens"], ix["resp_tokens"]
        qp, kp, vp = q.index_select(0, pt), k.index_select(0, pt), v.index_select(0, pt)  # [Np, H, D]
        o_p, lse_p, st_p = prims.fwd(qp, kp, vp, ix["cu_p"], ix["cu_p"], ix["max_p"], ix["max_p"], scale, True,
                                     None, softcap)
        o_p, lse_p = add_sink(o_p, lse_p, sinks)  # the sink enters each query's normaliser once
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
        out.index_copy_(0, pt, o_p)
        saved = [qp, kp, vp, o_p, lse_p]
        states = [st_p, None, None]
        if N > 0:
            qr, kr, vr = q.index_select(0, rt), k.index_select(0, rt), v.index_select(0, rt)  # [N, H, D]
            ka, va = (kp, vp) if ix["ka_index"] is None else (kp[ix["ka_index"]], vp[ix["ka_index"]])
            o_a, lse_a, st_a = prims.fwd(qr, ka, va, ix["cu_qa"], ix["cu_ka"], ix["max_qa"], ix["max_ka"], scale,
                                         False, None, softcap)
            o_b, lse_b, st_b = prims.fwd(qr, kr, vr, ix["cu_r"], ix["cu_r"], ix["max_r"], ix["max_r"], scale, True,
                                         None, softcap)
            o_r, lse_r = add_sink(*merge_attention(o_a, lse_a, o_b, lse_b), sinks)
            out.index_copy_(0, rt, o_r)
            saved += [qr, kr, vr, ka, va, o_r, lse_r]
            states[1:] = [st_a, st_b]
        ctx.save_for_backward(sinks, *saved)
        ctx.ix, ctx.N, ctx.scale, ctx.softcap, ctx.prims, ctx.states = ix, N, scale, softcap, prims, states
        ctx.shapes = (q.shape, k.shape, v.shape)
        return out

    @staticmethod
    def backward(ctx, dout):
        ix, N, scale, softcap, prims = ctx.ix, ctx.N, ctx.scale, ctx.softcap, ctx.prims
        st_p, st_a, st_b = ctx.states
        sinks, *saved = ctx.saved_tensors
        qp, kp, vp, o_p, lse_p = saved[:5]
        pt, rt = ix["prompt_tokens"], ix["resp_tokens"]
        q_shape, k_shape, v_shape = ctx.shapes
        dq = dout.new_empty(q_shape)
        dk = dout.new_empty(k_shape)
        dv = dout.new_empty(v_shape)
        do_p = dout.index_select(0, pt)
        dqp, dkp, dvp = prims.bwd(do_p, qp, kp, vp, o_p, lse_p, st_p, ix["cu_p"], ix["cu_p"], ix["max_p"],
                                  ix["max_p"], scale, True, None, softcap)
        d_sinks = sink_grad(do_p, o_p, lse_p, sinks) if sinks is not None and ctx.needs_input_grad[3] else None
        if N > 0:
            qr, kr, vr, ka, va, o_r, lse_r = saved[5:]
            do_r = dout.index_select(0, rt)
            # Both parts see the merged o/lse: each kernel's P is the merged softmax restricted to its keys.
            dqa, dka, dva = prims.bwd(do_r, qr, ka, va, o_r, lse_r, st_a, ix["cu_qa"], ix["cu_ka"], ix["max_qa"],
                                      ix["max_ka"], scale, False, None, softcap)
            dqb, dkb, dvb = prims.bwd(do_r, qr, kr, vr, o_r, lse_r, st_b, ix["cu_r"], ix["cu_r"], ix["max_r"],
                                      ix["max_r"], scale, True, None, softcap)
            if d_sinks is not None:
                d_sinks = d_sinks + sink_grad(do_r, o_r, lse_r, sinks)
            acc = lse_r.dtype  # sum the parts in fp32 (fp64 for fp64)
            dq.index_copy_(0, rt, (dqa.to(acc) + dqb.to(acc)).to(dq.dtype))
            dk.index_copy_(0, rt, dkb.to(dk.dtype))
            dv.index_copy_(0, rt, dvb.to(dv.dtype))
            dkp, dvp = dkp.to(acc), dvp.to(acc)
            if ix["ka_index"] is None:
                dkp, dvp = dkp + dka.to(acc), dvp + dva.to(acc)
            else:
                dkp.index_add_(0, ix["ka_index"], dka.to(acc))
                dvp.index_add_(0, ix["ka_index"], dva.to(acc))
        dq.index_copy_(0, pt, dqp.to(dq.dtype))
        dk.index_copy_(0, pt, dkp.to(dk.dtype))
        dv.index_copy_(0, pt, dvp.to(dv.dtype))
        return dq, dk, dv, d_sinks, None, None, None, None, None


def attend_copyfree(plan: ZorroPlan, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                    features: AttentionFeatures = NO_FEATURES,
                    prims: Optional[VarlenPrimitives] = None) -> torch.Tensor:
    """``q [1, Hq, T, D]``, ``k/v [1, Hkv, T, D]`` -> ``[1, T, Hq, D]``.

    ``features``: soft-capping goes to every kernel call, the sinks are merged once per query after the parts'
    merge. A sliding window that cuts inside the plan runs ``flash``'s window-tail response call instead of parts
    A/B (:func:`~zorro_verl.attention.varlen.attend_varlen`; see the module doc for why).

    ``prims`` None: the GPU flash kernels (fp16/bf16 CUDA only); tests pass
    :func:`~zorro_verl.attention.primitives.torch_primitives` to run the same logic on CPU in fp64.
    """
    if prims is None:
        check_flash_inputs("flash_copyfree", query)
        prims = flash_primitives()
    if features.window is not None:
        return attend_varlen(plan, query, key, value, scaling, features, prims)
    ix = copyfree_index(plan)
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, H, D]
    out = _CopyFreeAttention.apply(q, k, v, features.sinks, ix, plan.N, scaling, features.softcap,
                                   prims)  # [T, Hq, D]
    return out.unsqueeze(0)


BACKEND = Backend("flash_copyfree", attend_copyfree, copyfree_index, flash_available,
                  "flash varlen, prompt and own parts merged by log-sum-exp; no K/V copies (CUDA, fp16/bf16)",
                  ("cuda",))
