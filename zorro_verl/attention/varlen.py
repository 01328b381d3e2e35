"""Backend ``flash``: varlen split attention with flash kernels, the two-call gather design (docs/design/attention.md).

::

    call 1: prompts      q/k/v[prompt_token_index]   cu_seqlens over unique prompts, causal
    call 2: responses    q[resp_q_index] vs k/v[resp_kv_index] = per response [its prompt ; itself],
                         causal=True — flash kernels align the causal mask bottom-right when
                         seqlen_k > seqlen_q, which is exactly "all of the prompt + own prefix".

The gather of prompt K/V per response is differentiable (index backward sums into the one prompt copy). The
kernels are pluggable :class:`~zorro_verl.attention.primitives.VarlenPrimitives` (flash kernels on GPU, the
plain-torch reference in the CPU fp64 tests).
"""

from __future__ import annotations

from typing import Optional

import torch

from zorro_verl.attention.base import Backend
from zorro_verl.attention.features import NO_FEATURES, AttentionFeatures
from zorro_verl.attention.primitives import (
    VarlenPrimitives,
    check_flash_inputs,
    flash_available,
    flash_primitives,
    varlen_attention,
)
from zorro_verl.packing import ZorroPlan
from zorro_verl.packing.segments import cu_seqlens, segments_to_tokens

__all__ = ["BACKEND", "attend_varlen", "varlen_index", "window_index", "chunk_index"]


def varlen_index(plan: ZorroPlan) -> dict:
    """Index set of the gather design (memoised in the plan under ``"flash"``).

    * call 1 (prompts, causal): ``prompt_token_index [Np]``, ``cu_seqlens_prompt [G+1] int32``,
      ``max_seqlen_prompt`` (int);
    * call 2 (each non-empty response vs ``[its prompt ; itself]``, causal bottom-right):
      ``resp_q_index [N]`` (packed order), ``resp_kv_index [K]``, ``cu_seqlens_q [Bnz+1] int32``,
      ``cu_seqlens_k [Bnz+1] int32``, ``max_seqlen_q``, ``max_seqlen_k`` (ints);
    * ``out_index [T]``: each packed token's place in ``cat(out_call1 [Np], out_call2 [N])``.

    Tree plans: call 1 runs the roots, call 2 every other node against ``[its ancestor chain ; itself]``.
    """

    def build():
        if plan.tree is not None:
            return _tree_build()
        dev = plan.device
        prompt_tok = segments_to_tokens(plan.prompt_start, plan.prompt_lens, plan.num_prompt_tokens)
        rows = plan.nonempty_rows()  # [Bnz] packed order
        r = plan.response_lens[rows]
        p = plan.row_prompt_lens[rows]
        resp_tok = segments_to_tokens(plan.response_start[rows], r, plan.N)
        # K/V segments per response: [prompt of its group (p) ; its own tokens (r)].
        starts = torch.stack([plan.prompt_start[plan.row_group[rows]], plan.response_start[rows]], 1).flatten()
        kv_tok = segments_to_tokens(starts, torch.stack([p, r], 1).flatten(), plan.kv_total)
        out_index = torch.empty(plan.T, dtype=torch.long, device=dev)
        out_index[prompt_tok] = torch.arange(plan.num_prompt_tokens, device=dev)
        out_index[resp_tok] = plan.num_prompt_tokens + torch.arange(plan.N, device=dev)
        return {
            "prompt_token_index": prompt_tok,
            "cu_seqlens_prompt": cu_seqlens(plan.prompt_lens),
            "max_seqlen_prompt": plan.max_prompt_len,
            "resp_q_index": resp_tok,
            "resp_kv_index": kv_tok,
            "cu_seqlens_q": cu_seqlens(r),
            "cu_seqlens_k": cu_seqlens(p + r),
            "max_seqlen_q": plan.max_response_len,
            "max_seqlen_k": plan.max_row_len,
            "out_index": out_index,
        }

    def _tree_build():
        from zorro_verl.packing.tree import tree_chains

        tree, ch = plan.tree, tree_chains(plan)
        dev = plan.device
        kids = tree.children
        out_index = torch.empty(plan.T, dtype=torch.long, device=dev)
        out_index[ch["root_tokens"]] = torch.arange(tree.root_tokens, device=dev)
        out_index[ch["child_tokens"]] = tree.root_tokens + torch.arange(tree.child_tokens, device=dev)
        return {
            "prompt_token_index": ch["root_tokens"],
            "cu_seqlens_prompt": cu_seqlens(tree.node_len[tree.roots]),
            "max_seqlen_prompt": tree.max_root_len,
            "resp_q_index": ch["child_tokens"],
            "resp_kv_index": ch["kv_index"],
            "cu_seqlens_q": cu_seqlens(tree.node_len[kids]),
            "cu_seqlens_k": cu_seqlens(tree.node_pos0[kids] + tree.node_len[kids]),
            "max_seqlen_q": tree.max_child_len,
            "max_seqlen_k": tree.max_path_len,
            "out_index": out_index,
            "tree": True,
        }

    return plan.memo.get("flash", build)


def window_index(plan: ZorroPlan, window: int) -> dict:
    """Response call of a sliding-window layer (memoised per window): each non-empty response against
    ``[the window tail of its prompt ; itself]``, causal + window, bottom-right aligned.

    A response token at position ``p + t`` sees prompt keys with ``pos >= p + t - W + 1``; the first (``t = 0``)
    sees the most, the last ``L = min(p, W - 1)`` prompt tokens, so only that tail is gathered — prompt blocks
    entirely outside the window are never copied, and the kernel's band (``d = pos_q - pos_k < W``) does the rest.
    The tail lengths are not host ints, so the gathered keys fill a buffer of the bound
    ``K = Bnz * min(Pmax, W - 1) + N`` (Python ints of the plan: no host sync): ``resp_kv_index [K]`` (the unused
    rest reads token 0), ``resp_kv_valid [K] bool``, ``cu_seqlens_k [Bnz+1] int32`` (segments cover only the valid
    part) and ``max_seqlen_k`` (a bound); queries as in :func:`varlen_index`.
    """

    def build():
        v = varlen_index(plan)
        rows = plan.nonempty_rows()
        r = plan.response_lens[rows]
        p = plan.row_prompt_lens[rows]
        tail = p.clamp(max=window - 1)  # [Bnz] prompt keys within the window of the response's first token
        lk = min(plan.max_prompt_len, window - 1)
        K = plan.num_nonempty_responses * lk + plan.N
        starts = torch.stack([plan.prompt_start[plan.row_group[rows]] + p - tail, plan.response_start[rows]], 1)
        lens = torch.stack([tail, r], 1).flatten()
        used = lens.sum()
        # one trailing filler segment makes the expansion exactly K long without reading `used` on host; it would
        # count 0, 1, 2, ... past the packed row's end when K - used > T, so its entries are set to token 0
        kv_tok = segments_to_tokens(torch.cat([starts.flatten(), starts.new_zeros(1)]),
                                    torch.cat([lens, (K - used)[None]]), K)
        valid = torch.arange(K, device=plan.device) < used
        kv_tok = kv_tok.masked_fill(~valid, 0)
        return {"resp_kv_index": kv_tok, "resp_kv_valid": valid,
                "cu_seqlens_k": cu_seqlens(tail + r), "max_seqlen_k": lk + plan.max_response_len,
                "cu_seqlens_q": v["cu_seqlens_q"], "max_seqlen_q": v["max_seqlen_q"]}

    return plan.memo.get(("flash", "window", window), build)


def chunk_index(plan: ZorroPlan, chunk: int) -> dict:
    """Both calls of a chunked layer (memoised per chunk), cut into pieces at chunk boundaries so that every piece
    is one causal segment (bottom-right aligned) over keys of its own chunk; the gathered keys are
    :func:`varlen_index`'s (no new copy), only the ``cu_seqlens`` change:

    * call 1: each prompt (tree: root) cut at multiples of ``C`` (its positions start at 0), queries = keys:
      ``cu_seqlens_prompt`` over ``[G * ceil(Pmax / C)]`` pieces (zero-length ones past a prompt's end);
    * call 2: each response (tree: non-root node) with ``p`` prefix keys (its prompt / ancestor chain) and ``r`` own
      tokens in its ``[prefix ; itself]`` key segment becomes a query-less piece over the prefix head outside its
      first chunk (``p - p % C`` keys), then one piece per chunk its tokens reach: the first with keys
      ``[the prefix tail of its chunk (p % C) ; its tokens in that chunk]``, the others with keys = queries.

    A piece's queries are the last of its keys' contiguous positions, so the kernel's causal band (and a window's,
    ``d = pos_q - pos_k``) is the ordinary rule inside the chunk. ``cu_seqlens_q`` / ``cu_seqlens_k`` over
    ``[Bnz * (ceil(Rmax / C) + 2)]`` pieces, ``max_seqlen_*`` bounds (host ints of the plan: no host sync).
    """

    def build():
        C, dev = chunk, plan.device
        v = varlen_index(plan)
        if plan.tree is not None:
            tree = plan.tree
            root_len, p, r = tree.node_len[tree.roots], tree.node_pos0[tree.children], tree.node_len[tree.children]
            max_root, max_child = tree.max_root_len, tree.max_child_len
        else:
            rows = plan.nonempty_rows()
            root_len, p, r = plan.prompt_lens, plan.row_prompt_lens[rows], plan.response_lens[rows]
            max_root, max_child = plan.max_prompt_len, plan.max_response_len
        jp = torch.arange(max(1, -(-max_root // C)), device=dev)
        plen = (root_len[:, None] - jp[None] * C).clamp(0, C).flatten()  # [G * np] prompt pieces
        tail = p % C  # prefix keys inside the chunk of a response's first token
        cs = (p // C)[:, None] + torch.arange(-(-max_child // C) + 1, device=dev)[None]  # [Bnz, m] chunk ids
        ql = (torch.minimum((p + r)[:, None], (cs + 1) * C) - torch.maximum(p[:, None], cs * C)).clamp(min=0)
        kl = ql.clone()
        kl[:, 0] += tail
        ql = torch.cat([torch.zeros_like(p)[:, None], ql], 1)  # the query-less piece over the prefix head first
        kl = torch.cat([(p - tail)[:, None], kl], 1)
        return {"cu_seqlens_prompt": cu_seqlens(plen), "max_seqlen_prompt": min(C, max_root),
                "cu_seqlens_q": cu_seqlens(ql.flatten()), "cu_seqlens_k": cu_seqlens(kl.flatten()),
                "max_seqlen_q": min(C, max_child), "max_seqlen_k": v["max_seqlen_k"]}

    return plan.memo.get(("flash", "chunk", chunk), build)


class _GatherRows(torch.autograd.Function):
    """``x [T, H, D] -> x[index] [K, H, D]``; backward adds only the ``valid`` rows' gradients back (rows outside
    every varlen segment may hold whatever the kernel left there)."""

    @staticmethod
    def forward(ctx, x, index, valid):
        ctx.save_for_backward(index, valid)
        ctx.T = x.shape[0]
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, g):
        index, valid = ctx.saved_tensors
        dx = g.new_zeros((ctx.T, *g.shape[1:]))
        dx.index_add_(0, index, torch.where(valid[:, None, None], g, 0))
        return dx, None, None


def attend_varlen(plan: ZorroPlan, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  scaling: float, features: AttentionFeatures = NO_FEATURES,
                  prims: Optional[VarlenPrimitives] = None) -> torch.Tensor:
    """``q [1, Hq, T, D]``, ``k/v [1, Hkv, T, D]`` -> ``[1, T, Hq, D]``.

    ``features``: the window and soft-cap go to the kernels (both calls' segments end at their queries' last
    position, so the bottom-right window is ``pos_q - pos_k < W``); a windowed layer's response call gathers only
    each prompt's window tail (:func:`window_index`); a chunked layer's calls are cut into one segment per chunk
    piece (:func:`chunk_index`); the sinks are merged once per query.

    ``prims`` None: the GPU flash kernels (fp16/bf16 CUDA only). Tests pass
    :func:`~zorro_verl.attention.primitives.torch_primitives` to run the same index logic on CPU in fp64.
    """
    if prims is None:
        check_flash_inputs("flash", query)
        prims = flash_primitives()
    idx = varlen_index(plan)
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, H, D]
    pi = idx["prompt_token_index"]
    cu_p = idx["cu_seqlens_prompt"]
    mp = idx["max_seqlen_prompt"]
    kw = dict(window=features.window, softcap=features.softcap, sinks=features.sinks)
    tree = "tree" in idx  # tree plans gather the whole [ancestor chain ; itself]: the kernel's band does a window
    if features.chunk is not None:  # pieces cut at chunk boundaries over the same gathered keys (chunk_index)
        c = chunk_index(plan, features.chunk)
        cu_p, mp = c["cu_seqlens_prompt"], c["max_seqlen_prompt"]
        parts = [varlen_attention(q[pi], k[pi], v[pi], cu_p, cu_p, mp, mp, scaling, True, prims, **kw)]
        if (plan.tree.child_tokens if tree else plan.N) > 0:
            qi, kvi = idx["resp_q_index"], idx["resp_kv_index"]
            parts.append(varlen_attention(q[qi], k[kvi], v[kvi], c["cu_seqlens_q"], c["cu_seqlens_k"],
                                          c["max_seqlen_q"], c["max_seqlen_k"], scaling, True, prims, **kw))
        return torch.cat(parts, 0)[idx["out_index"]].unsqueeze(0)
    parts = [varlen_attention(q[pi], k[pi], v[pi], cu_p, cu_p, mp, mp, scaling, True, prims, **kw)]
    if (plan.tree.child_tokens if tree else plan.N) > 0 and (features.window is None or tree):
        qi, kvi = idx["resp_q_index"], idx["resp_kv_index"]
        parts.append(varlen_attention(q[qi], k[kvi], v[kvi], idx["cu_seqlens_q"], idx["cu_seqlens_k"],
                                      idx["max_seqlen_q"], idx["max_seqlen_k"], scaling, True, prims, **kw))
    elif plan.N > 0 and not tree:  # only the prompt tail inside the window is gathered (window_index)
        w = window_index(plan, features.window)
        kvi, ok = w["resp_kv_index"], w["resp_kv_valid"]
        parts.append(varlen_attention(q[idx["resp_q_index"]], _GatherRows.apply(k, kvi, ok),
                                      _GatherRows.apply(v, kvi, ok), w["cu_seqlens_q"], w["cu_seqlens_k"],
                                      w["max_seqlen_q"], w["max_seqlen_k"], scaling, True, prims, **kw))
    return torch.cat(parts, 0)[idx["out_index"]].unsqueeze(0)  # [1, T, Hq, D]


BACKEND = Backend("flash", attend_varlen, varlen_index, flash_available,
                  "flash varlen, two calls; per-response gather of the prompt's K/V (CUDA, fp16/bf16)", ("cuda",))
