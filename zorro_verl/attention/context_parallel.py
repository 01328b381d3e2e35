"""Split attention under context parallelism (docs/design/megatron.md "Context parallelism").

Each rank of the CP group holds ``L`` tokens of the packed row (:func:`zorro_verl.packing.context_parallel.cp_shard`:
runs cut zigzag, so a prompt's tokens and its responses' tokens are spread over the ranks). A response's queries
need its whole prompt's keys wherever they live, so the keys and values are **all-gathered** over the group (one
collective of ``[L, 2 Hkv D]`` per layer; autograd-aware: the backward sums every rank's ``dk`` / ``dv`` into the
owner's rows, a reduce-scatter) and put back in packed order; then this rank's queries attend with the split
attention's rule at their global packed positions — a prompt token to its prompt's causal past, a response token
to its whole prompt and its own past, a trie node to its ancestors and its own past — which is the visibility
``plan.full_index()`` gives (the keys of an ordinary row up to the query's column). Exact, forward and backward:
every query sees exactly the keys it sees without CP, and each key's gradient is the sum of every query's.

Two kernels run this rule:

* ``sdpa`` / ``eager`` (:data:`CP_MATH`): one dense masked call per rank (``[Hq, L, T]`` scores): every feature
  (windows, chunks, sinks, soft-capping), the attention FLOPs ``L x T`` per head rather than the causal share. Pad
  tokens (``shard.valid`` False) attend to one key and output 0 (never read, no gradient to any key).
* ``flash_copyfree`` / ``flash`` (:data:`CP_VARLEN`): varlen flash calls over exactly the visible keys, merged by
  log-sum-exp as the copy-free backend merges its parts (:func:`cp_varlen_index`): the rank's tokens are cut into
  *runs* (consecutive packed tokens of one node: a prompt, a response, a trie node); an **own** call, causal, gives
  each run its node's keys from the node's start up to the run's end (bottom-right aligned: a run at offset ``a`` of
  its node sees keys ``[0, a + i]`` of it); one **ancestor** call per depth ``d``, non-causal, gives every token below
  depth ``d`` its depth-``d`` ancestor's keys (a response its prompt; queries grouped by that ancestor, so each
  ancestor's keys are read once per call, not per descendant). The attention FLOPs are the causal share (the FLOP
  model's ideal); the own call copies each run's key range out of the gathered row (at most ``T`` keys per rank:
  O(the all-gathered buffer)). Backward: every part's kernel backward with the merged ``o`` / ``lse`` (the ring
  trick), ``dk`` / ``dv`` summed into the gathered row's slots. Soft-capping goes to every call; windows, chunks and
  sinks run on the dense kernels (refused here by name).

Imports torch and the packing layer.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zorro_verl.attention.copyfree import merge_attention
from zorro_verl.attention.features import NO_FEATURES, AttentionFeatures, dense_attention, position_visible
from zorro_verl.attention.primitives import (
    VarlenPrimitives,
    check_flash_inputs,
    cpu_flash_primitives,
    flash_primitives,
)
from zorro_verl.packing import ZorroPlan
from zorro_verl.packing.context_parallel import CPShard
from zorro_verl.packing.segments import cu_seqlens, segments_to_tokens

__all__ = ["cp_attend", "cp_visible_mask", "cp_varlen_index", "gather_cp_rows", "CP_MATH", "CP_VARLEN"]

#: Backends that run under context parallelism on the dense kernels, and the dense math each maps to.
CP_MATH = {"sdpa": "sdpa", "eager": "eager"}
#: Backends that run under context parallelism on the varlen flash kernels (module docstring).
CP_VARLEN = ("flash_copyfree", "flash")


class _GatherKV(torch.autograd.Function):
    """``x [L, F]`` on every rank -> ``[cp * L, F]`` rank-major; backward: the sum of every rank's gradient of this
    rank's rows (a reduce-scatter; on gloo, which has none, an all-reduce and this rank's slice)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        cp = dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(cp)]
        dist.all_gather(parts, x.contiguous(), group=group)  # looked up per call: tests count its bytes
        return torch.cat(parts, 0)

    @staticmethod
    def backward(ctx, grad):
        group = ctx.group
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        L = grad.shape[0] // cp
        if dist.get_backend(group) == "gloo":
            grad = grad.contiguous()
            dist.all_reduce(grad, group=group)
            return grad[rank * L: (rank + 1) * L], None
        out = grad.new_empty(L, *grad.shape[1:])
        dist.reduce_scatter_tensor(out, grad.contiguous(), group=group)
        return out, None


def cp_visible_mask(plan: ZorroPlan, shard: CPShard, features: AttentionFeatures = NO_FEATURES) -> torch.Tensor:
    """``[L, T] bool``: which packed keys each of this rank's queries attends to (True = attend). A query sees the
    packed tokens of an ordinary row containing it, up to its own column (``plan.full_index()``; a prompt token or
    a shared trie node reads the same keys from every row containing it); ``features``' window / chunk rule on the
    original positions is applied on top. Pad queries see key 0 only (their output is dropped). Memoised on the
    plan per shard layout and rule."""
    rule = features.position_rule

    def build():
        dev, T = plan.device, plan.T
        fi = plan.full_index()  # [B, S], -1 on pads
        B, S = fi.shape
        ok = fi >= 0
        row_of = torch.zeros(T, dtype=torch.long, device=dev)
        col_of = torch.zeros(T, dtype=torch.long, device=dev)
        rows = torch.arange(B, device=dev)[:, None].expand(B, S)[ok]
        cols = torch.arange(S, device=dev)[None, :].expand(B, S)[ok]
        row_of[fi[ok]] = rows  # any row containing the token (duplicates agree on the keys)
        col_of[fi[ok]] = cols
        q = shard.index.clamp(max=T - 1) if T else shard.index
        keys = fi[row_of[q]]  # [L, S]
        see = (keys >= 0) & (torch.arange(S, device=dev)[None, :] <= col_of[q][:, None])
        mask = torch.zeros(shard.local_len, T + 1, dtype=torch.bool, device=dev)
        mask.scatter_(1, torch.where(see, keys, T), True)
        mask = mask[:, :T]
        if rule is not None:
            pos = plan.position_ids
            mask &= position_visible(pos[q][:, None], pos[None, :], rule)
        mask[~shard.valid] = False
        if T:
            mask[~shard.valid, 0] = True
        return mask

    key = ("context_parallel", shard.cp_size, shard.rank, shard.local_len, rule)
    return plan.memo.get(key, build)


def _nodes(plan: ZorroPlan):
    """The plan's nodes as a trie: ``(node_start [M], node_len [M], node_depth [M], node_anc [M, levels],
    token_node [T], levels)``. A prefix-tree plan's own trie; a prompt plan's prompts (depth 0) with their responses
    as children (depth 1), ``M = G + B``."""
    if plan.tree is not None:
        t = plan.tree
        return t.node_start, t.node_len, t.node_depth, t.node_anc, t.token_node, t.levels
    dev, G, B = plan.device, plan.G, plan.B
    _, seg, _ = plan.token_layout()  # a prompt's segment is its group id, a response's G + row
    start = torch.cat([plan.prompt_start, plan.response_start])
    length = torch.cat([plan.prompt_lens, plan.response_lens])
    depth = torch.cat([torch.zeros(G, dtype=torch.long, device=dev), torch.ones(B, dtype=torch.long, device=dev)])
    anc = torch.stack([torch.cat([torch.arange(G, device=dev), plan.row_group]),
                       torch.cat([torch.full((G,), -1, dtype=torch.long, device=dev),
                                  G + torch.arange(B, device=dev)])], 1)  # [M, 2]
    return start, length, depth, anc, seg, 2


def cp_varlen_index(plan: ZorroPlan, shard: CPShard) -> dict:
    """Index set of the varlen CP attention (module docstring), memoised on the plan per shard layout.

    ``q_local [Lv] int64``: this rank's valid tokens (their place in its slice; the queries' order below, "own
    order"); ``own``: the causal call, ``(k_index, cu_q, cu_k, max_q, max_k)`` with ``k_index [Nk] int64`` into the
    gathered packed row; ``ancestors``: per depth with descendants here, ``(q_index [n] int64`` into own order,
    ``k_index, cu_q, cu_k, max_q, max_k)``. Host syncs (the segment counts and maxima) happen once, at the build."""
    def build():
        start, length, depth, anc, token_node, levels = _nodes(plan)
        q_local = shard.valid.nonzero().flatten()  # [Lv]
        g = shard.index[q_local]  # their packed positions, ascending
        Lv = g.numel()
        if Lv == 0:
            return {"q_local": q_local, "own": None, "ancestors": []}
        node = token_node[g]
        brk = torch.ones(Lv, dtype=torch.bool, device=g.device)
        brk[1:] = (node[1:] != node[:-1]) | (g[1:] != g[:-1] + 1)  # a new run: another node, or a gap
        first = brk.nonzero().flatten()  # [R]
        run_len = torch.diff(first, append=first.new_tensor([Lv]))
        run_node = node[first]
        k_start = start[run_node]
        k_len = g[first + run_len - 1] + 1 - k_start  # from the node's start to the run's end
        n_k = int(k_len.sum())
        own = (segments_to_tokens(k_start, k_len, n_k), cu_seqlens(run_len), cu_seqlens(k_len),
               int(run_len.max()), int(k_len.max()))
        ancestors = []
        tok_depth = depth[node]
        for d in range(levels - 1):
            sel = (tok_depth > d).nonzero().flatten()
            if sel.numel() == 0:
                continue
            a = anc[node[sel], d]  # each token's depth-d ancestor
            order = torch.argsort(a, stable=True)  # grouped by ancestor (node ids ascend in packed order)
            q_index = sel[order]
            uniq, counts = torch.unique_consecutive(a[order], return_counts=True)
            klen = length[uniq]
            ancestors.append((q_index, segments_to_tokens(start[uniq], klen, int(klen.sum())), cu_seqlens(counts),
                              cu_seqlens(klen), int(counts.max()), int(klen.max())))
        return {"q_local": q_local, "own": own, "ancestors": ancestors}

    return plan.memo.get(("context_parallel_varlen", shard.cp_size, shard.rank, shard.local_len), build)


class _CPVarlen(torch.autograd.Function):
    """``q [Lv, Hq, D]`` (this rank's valid queries, own order), ``k / v [T, Hkv, D]`` (the gathered packed row) ->
    ``out [Lv, Hq, Dv]``: the own call plus one call per ancestor depth, merged by log-sum-exp; backward with the
    merged ``o`` / ``lse`` for every part, ``dk`` / ``dv`` summed into the row's slots."""

    @staticmethod
    def forward(ctx, q, k, v, ix: dict, scale: float, softcap, prims: VarlenPrimitives):
        ki, cu_q, cu_k, max_q, max_k = ix["own"]
        o, lse, st = prims.fwd(q, k.index_select(0, ki), v.index_select(0, ki), cu_q, cu_k, max_q, max_k, scale,
                               True, None, softcap)  # [Lv, Hq, Dv], [Hq, Lv]
        states = [st]
        for qi, ka, cq, ck, mq, mk in ix["ancestors"]:
            o_a, lse_a, st_a = prims.fwd(q.index_select(0, qi), k.index_select(0, ka), v.index_select(0, ka), cq,
                                         ck, mq, mk, scale, False, None, softcap)
            o_m, lse_m = merge_attention(o.index_select(0, qi), lse.index_select(1, qi), o_a, lse_a)
            o.index_copy_(0, qi, o_m)
            lse.index_copy_(1, qi, lse_m)
            states.append(st_a)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.ix, ctx.scale, ctx.softcap, ctx.prims, ctx.states = ix, scale, softcap, prims, states
        return o

    @staticmethod
    def backward(ctx, dout):
        q, k, v, o, lse = ctx.saved_tensors
        ix, scale, softcap, prims, states = ctx.ix, ctx.scale, ctx.softcap, ctx.prims, ctx.states
        acc = lse.dtype  # sum the parts in fp32 (fp64 for fp64)
        ki, cu_q, cu_k, max_q, max_k = ix["own"]
        dq, dko, dvo = prims.bwd(dout, q, k.index_select(0, ki), v.index_select(0, ki), o, lse, states[0], cu_q,
                                 cu_k, max_q, max_k, scale, True, None, softcap)
        dq = dq.to(acc)
        dk = torch.zeros(k.shape, dtype=acc, device=k.device).index_add_(0, ki, dko.to(acc))
        dv = torch.zeros(v.shape, dtype=acc, device=v.device).index_add_(0, ki, dvo.to(acc))
        for (qi, ka, cq, ck, mq, mk), st in zip(ix["ancestors"], states[1:]):
            dqa, dka, dva = prims.bwd(dout.index_select(0, qi), q.index_select(0, qi), k.index_select(0, ka),
                                      v.index_select(0, ka), o.index_select(0, qi), lse.index_select(1, qi), st, cq,
                                      ck, mq, mk, scale, False, None, softcap)
            dq.index_add_(0, qi, dqa.to(acc))
            dk.index_add_(0, ka, dka.to(acc))
            dv.index_add_(0, ka, dva.to(acc))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def cp_attend(plan: ZorroPlan, backend: str, shard: CPShard, query: torch.Tensor, key: torch.Tensor,
              value: torch.Tensor, scaling: float, features: AttentionFeatures | None = None,
              prims: VarlenPrimitives | None = None) -> torch.Tensor:
    """Split attention of ``plan`` over the CP group of ``shard``.

    Args:
        backend: ``sdpa`` / ``eager`` (:data:`CP_MATH`: one dense masked call) or ``flash_copyfree`` / ``flash``
            (:data:`CP_VARLEN`: varlen flash calls over the visible keys); others are refused (ValueError).
        query: ``[1, Hq, L, D]``; key / value: ``[1, Hkv, L, D]`` (``value`` may have its own head dim) — this
            rank's tokens (``shard.index`` order).
        features: the layer's window / chunk / sinks ``[Hq]`` / soft-cap (:func:`~zorro_verl.attention.attend`);
            the varlen kernels take soft-capping only.
        prims: the varlen kernels (None: the GPU flash kernels on CUDA, PyTorch's CPU flash kernels on CPU; tests
            pass :func:`~zorro_verl.attention.primitives.torch_primitives` for fp64).

    Returns:
        ``[1, L, Hq, Dv]``: this rank's attention output (0 on pad tokens).
    """
    if backend not in CP_MATH and backend not in CP_VARLEN:
        raise ValueError(f"attention backend: expected one of {sorted(CP_MATH) + list(CP_VARLEN)} under context "
                         f"parallelism, got {backend!r}; zorro's CP attention all-gathers keys / values and runs "
                         "dense masked or varlen flash calls on them. Set the zorro backend to 'flash_copyfree' (GPU) "
                         "or 'sdpa'.")
    features = (features or NO_FEATURES).for_plan(plan)
    features.check_heads(query.shape[1])
    varlen = backend in CP_VARLEN
    if varlen and (features.position_rule is not None or features.sinks is not None):
        raise ValueError(f"attention backend: {backend!r} under context parallelism runs varlen flash calls without "
                         "windows, chunks or sinks; this layer has "
                         f"{'a window / chunk' if features.position_rule is not None else 'sinks'}. Set the zorro "
                         "backend to 'sdpa' (its dense masked call takes every feature).")
    if varlen and prims is None:
        if query.device.type == "cpu":
            prims = cpu_flash_primitives()
        else:
            check_flash_inputs(backend, query)
            prims = flash_primitives()
    L, T = shard.local_len, plan.T
    if query.shape[2] != L or key.shape[2] != L or value.shape[2] != L:
        raise ValueError(f"query / key / value: expected this rank's {L} tokens on dim 2, got "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}.")
    hkv, dk, dv = key.shape[1], key.shape[3], value.shape[3]
    kv = torch.cat([key[0].transpose(0, 1).reshape(L, hkv * dk), value[0].transpose(0, 1).reshape(L, hkv * dv)], 1)
    if shard.cp_size > 1:
        kv = _GatherKV.apply(kv, shard.group)  # [cp * L, F], rank-major
    kv = kv.index_select(0, shard.gathered_index)  # [T, F] packed order (backward: index_add into the slots)
    if varlen:
        ix = cp_varlen_index(plan, shard)
        ql = ix["q_local"]
        out = query.new_zeros(L, query.shape[1], dv)
        if ql.numel():
            q = query[0].transpose(0, 1).index_select(0, ql)  # [Lv, Hq, D]
            o = _CPVarlen.apply(q, kv[:, :hkv * dk].view(T, hkv, dk), kv[:, hkv * dk:].view(T, hkv, dv), ix,
                                scaling, features.softcap, prims)  # [Lv, Hq, Dv]
            out = out.index_copy(0, ql, o)  # pad tokens: 0, no gradient
        else:  # no query here: still a gradient (zeros) for the gather, whose backward is a collective
            out = out + 0 * kv.sum()
        return out[None]
    k_all = kv[:, :hkv * dk].view(T, hkv, dk).transpose(0, 1)[None]
    v_all = kv[:, hkv * dk:].view(T, hkv, dv).transpose(0, 1)[None]
    mask = cp_visible_mask(plan, shard, features)
    out = dense_attention(query, k_all, v_all, scaling, mask=mask[None, None], math=CP_MATH[backend],
                          features=features)  # [1, Hq, L, Dv]
    out = out * shard.valid.to(out.dtype)[None, None, :, None]  # pad queries: output 0, no gradient to any key
    return out.transpose(1, 2)


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, shard: CPShard):
        ctx.shard = shard
        m = shard.max_rows
        buf = local.new_zeros(m, *local.shape[1:])
        buf[: local.shape[0]] = local
        parts = [torch.empty_like(buf) for _ in range(shard.cp_size)]
        dist.all_gather(parts, buf, group=shard.group)
        return torch.cat(parts, 0)[shard.gather_index]

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.shard.rows], None


def gather_cp_rows(local: torch.Tensor, shard: CPShard) -> torch.Tensor:
    """``[N_s, ...]`` values of this rank's head rows (``shard.rows`` order) -> ``[N, ...]``, original row order, on
    every rank of the CP group. Backward: the gradient of this rank's rows only — every rank computing the same loss
    on the gathered values, the sum of the ranks' parameter gradients (megatron's data-parallel reduction, which
    includes the CP ranks) is the gradient of one such loss."""
    if shard.cp_size == 1:
        return local[shard.gather_index]
    if shard.max_rows == 0:
        return local.new_zeros(0, *local.shape[1:])
    return _GatherRows.apply(local, shard)
