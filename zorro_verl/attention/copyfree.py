"""Backend ``flash_copyfree``: varlen split attention without a per-response copy of the prompt's K/V
(docs/design/attention.md).

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
    cpu_flash_primitives,
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

    if plan.tree is not None:
        return plan.memo.get("flash_copyfree", lambda: _tree_index(plan))

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


def _tree_index(plan: ZorroPlan) -> dict:
    """Copy-free index set of a tree plan. ``self``: every node against itself, causal, over the packed row as it
    is (nodes are contiguous: ``cu_self [M+1] int32``). ``levels``: per node depth ``d`` that has descendants, one
    non-causal call — queries the subtree below each depth-``d`` node (contiguous in DFS order), keys the node's own
    tokens — as ``(q_index, k_index, cu_q, cu_k, max_q, max_k)``. A token at depth ``k`` thus gets ``k + 1``
    partial results (its ancestors' and its own), merged by log-sum-exp; each key token is read by one level only,
    so nothing is copied per descendant."""
    tree = plan.tree
    levels = []
    for d, (n, ktok, qtok, max_k, max_q) in enumerate(tree.level_counts):
        if n == 0 or qtok == 0:
            continue
        has = (tree.node_depth == d) & (tree.node_sub_end > tree.node_start + tree.node_len)  # [M]
        nodes = torch.argsort((~has).to(torch.int8), stable=True)[:n]  # those n nodes, packed order; no host sync
        start, ln = tree.node_start[nodes], tree.node_len[nodes]
        below = tree.node_sub_end[nodes] - start - ln
        levels.append((segments_to_tokens(start + ln, below, qtok), segments_to_tokens(start, ln, ktok),
                       cu_seqlens(below), cu_seqlens(ln), max_q, max_k))
    return {"cu_self": cu_seqlens(tree.node_len), "max_self": max(tree.max_root_len, tree.max_child_len),
            "levels": levels}


class _TreeCopyFree(torch.autograd.Function):
    """Tree plans: ``q [T, Hq, D], k/v [T, Hkv, D]`` -> ``out [T, Hq, D]``; the self call plus one call per
    ancestor level merged by log-sum-exp, backward with the merged ``o`` / ``lse`` for every part."""

    @staticmethod
    def forward(ctx, q, k, v, ix: dict, scale: float, prims: VarlenPrimitives):
        cu, mx = ix["cu_self"], ix["max_self"]
        o, lse, st = prims.fwd(q, k, v, cu, cu, mx, mx, scale, True)  # [T, Hq, D], [Hq, T]
        states = [st]
        for qi, ki, cu_q, cu_k, max_q, max_k in ix["levels"]:
            o_l, lse_l, st_l = prims.fwd(q.index_select(0, qi), k.index_select(0, ki), v.index_select(0, ki), cu_q,
                                         cu_k, max_q, max_k, scale, False)
            o_m, lse_m = merge_attention(o.index_select(0, qi), lse.index_select(1, qi), o_l, lse_l)
            o.index_copy_(0, qi, o_m)
            lse.index_copy_(1, qi, lse_m)
            states.append(st_l)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.ix, ctx.scale, ctx.prims, ctx.states = ix, scale, prims, states
        return o

    @staticmethod
    def backward(ctx, dout):
        q, k, v, o, lse = ctx.saved_tensors
        ix, scale, prims, states = ctx.ix, ctx.scale, ctx.prims, ctx.states
        cu, mx = ix["cu_self"], ix["max_self"]
        dq, dk, dv = prims.bwd(dout, q, k, v, o, lse, states[0], cu, cu, mx, mx, scale, True)
        if not ix["levels"]:
            return dq, dk, dv, None, None, None
        acc = lse.dtype  # sum the parts in fp32 (fp64 for fp64)
        dq, dk, dv = dq.to(acc), dk.to(acc), dv.to(acc)
        for (qi, ki, cu_q, cu_k, max_q, max_k), st in zip(ix["levels"], states[1:]):
            # every part sees the merged o/lse: its kernel's P is the merged softmax restricted to its keys
            dql, dkl, dvl = prims.bwd(dout.index_select(0, qi), q.index_select(0, qi), k.index_select(0, ki),
                                      v.index_select(0, ki), o.index_select(0, qi), lse.index_select(1, qi), st,
                                      cu_q, cu_k, max_q, max_k, scale, False)
            dq.index_add_(0, qi, dql.to(acc))
            dk.index_add_(0, ki, dkl.to(acc))
            dv.index_add_(0, ki, dvl.to(acc))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def merge_attention(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor):
    """Merge two partial attentions over disjoint key sets. ``o_* [Tq, Hq, D]``, ``lse_* [Hq, Tq]`` fp32/fp64 ->
    ``(o [Tq, Hq, D] in o_a's dtype, lse [Hq, Tq])``; the weights are taken in the lse dtype."""
    lse = torch.logaddexp(lse_a, lse_b)  # [Hq, Tq]
    w_a = torch.exp(lse_a - lse).transpose(0, 1)[..., None]  # [Tq, Hq, 1]
    w_b = torch.exp(lse_b - lse).transpose(0, 1)[..., None]
    o = w_a * o_a.to(lse.dtype) + w_b * o_b.to(lse.dtype)
    return o.to(o_a.dtype), lse


def _part_a_keys(kp: torch.Tensor, vp: torch.Tensor, ix: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Part A's keys/values: the prompt call's ``[Np, Hkv, D]``, or those of the groups with a response token."""
    if ix["ka_index"] is None:
        return kp, vp
    return kp[ix["ka_index"]], vp[ix["ka_index"]]


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
        lse_r = None
        states = [st_p, None, None]
        if N > 0:
            qr, kr, vr = q.index_select(0, rt), k.index_select(0, rt), v.index_select(0, rt)  # [N, H, D]
            ka, va = _part_a_keys(kp, vp, ix)
            o_a, lse_a, st_a = prims.fwd(qr, ka, va, ix["cu_qa"], ix["cu_ka"], ix["max_qa"], ix["max_ka"], scale,
                                         False, None, softcap)
            o_b, lse_b, st_b = prims.fwd(qr, kr, vr, ix["cu_r"], ix["cu_r"], ix["max_r"], ix["max_r"], scale, True,
                                         None, softcap)
            o_r, lse_r = add_sink(*merge_attention(o_a, lse_a, o_b, lse_b), sinks)
            out.index_copy_(0, rt, o_r)
            states[1:] = [st_a, st_b]
        # Saved: the packed q/k/v and out, as a stock attention saves them; the backward gathers its parts again
        # (O(T) copies) instead of keeping the permuted copies and each part's output beside them.
        ctx.save_for_backward(sinks, q, k, v, out, lse_p, lse_r)
        ctx.ix, ctx.N, ctx.scale, ctx.softcap, ctx.prims, ctx.states = ix, N, scale, softcap, prims, states
        ctx.shapes = (q.shape, k.shape, v.shape)
        return out

    @staticmethod
    def backward(ctx, dout):
        ix, N, scale, softcap, prims = ctx.ix, ctx.N, ctx.scale, ctx.softcap, ctx.prims
        st_p, st_a, st_b = ctx.states
        sinks, q, k, v, out, lse_p, lse_r = ctx.saved_tensors
        pt, rt = ix["prompt_tokens"], ix["resp_tokens"]
        qp, kp, vp, o_p = (x.index_select(0, pt) for x in (q, k, v, out))
        q_shape, k_shape, v_shape = ctx.shapes
        dq = dout.new_empty(q_shape)
        dk = dout.new_empty(k_shape)
        dv = dout.new_empty(v_shape)
        do_p = dout.index_select(0, pt)
        dqp, dkp, dvp = prims.bwd(do_p, qp, kp, vp, o_p, lse_p, st_p, ix["cu_p"], ix["cu_p"], ix["max_p"],
                                  ix["max_p"], scale, True, None, softcap)
        d_sinks = sink_grad(do_p, o_p, lse_p, sinks) if sinks is not None and ctx.needs_input_grad[3] else None
        if N > 0:
            qr, kr, vr, o_r = (x.index_select(0, rt) for x in (q, k, v, out))
            ka, va = _part_a_keys(kp, vp, ix)
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
    merge. A sliding window or a chunk that cuts inside the plan runs ``flash``'s calls instead of parts A/B
    (:func:`~zorro_verl.attention.varlen.attend_varlen`: the window-tail response call, the chunk pieces; see the
    module doc for why).

    ``prims`` None: the GPU flash kernels (fp16/bf16 CUDA only); tests pass
    :func:`~zorro_verl.attention.primitives.torch_primitives` to run the same logic on CPU in fp64.
    """
    if prims is None:
        if query.device.type == "cpu":  # PyTorch's CPU flash kernels, one call per segment (any float dtype)
            prims = cpu_flash_primitives()
        else:
            check_flash_inputs("flash_copyfree", query)
            prims = flash_primitives()
    if features.window is not None or features.chunk is not None or (plan.tree is not None and not features.plain):
        # windows, chunks (and, for prefix trees, sinks / soft-capping): the gather design's calls, exact
        return attend_varlen(plan, query, key, value, scaling, features, prims)
    ix = copyfree_index(plan)
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, H, D]
    if plan.tree is not None:  # the self call reads the packed row as it is: kernels want contiguous rows
        return _TreeCopyFree.apply(q.contiguous(), k.contiguous(), v.contiguous(), ix, scaling, prims).unsqueeze(0)
    out = _CopyFreeAttention.apply(q, k, v, features.sinks, ix, plan.N, scaling, features.softcap,
                                   prims)  # [T, Hq, D]
    return out.unsqueeze(0)


def _available(device: torch.device) -> bool:
    """CPU: always (PyTorch's CPU flash kernels); CUDA: where the flash kernels are."""
    return torch.device(device).type == "cpu" or flash_available(device)


BACKEND = Backend("flash_copyfree", attend_copyfree, copyfree_index, _available,
                  "flash varlen, prompt and own parts merged by log-sum-exp; no K/V copies (CUDA fp16/bf16 flash "
                  "kernels; CPU: PyTorch's CPU flash kernels per segment, any float dtype)")
