"""Backends ``sdpa`` and ``eager``: the reference split attention, two dense calls on padded per-group /
per-response blocks (CPU and GPU, any dtype; docs/design/attention.md).

::

    call 1 (prompts):   [G, Hq, Pmax, D]  causal; right padding is harmless under a causal mask
    call 2 (responses): q [B, Hq, Rmax, D]  vs  k/v [B, Hkv, Pmax + Rmax, D] = [prompt of its group ; itself]
                        mask: prompt key j < P_g, own key k <= q

Memory is ``O(G Pmax^2 + B Rmax (Pmax + Rmax))`` scores — never ``T^2`` over the micro-batch. The gather
``k_prompt[row_group]`` sums the n responses' gradients into the single prompt copy.

``sdpa`` uses ``torch.nn.functional.scaled_dot_product_attention``; ``eager`` is explicit matmul/softmax that keeps
fp64 in fp64 (transformers' own eager path upcasts to fp32 only, losing fp64). With no shared prompt (``G == B``)
``sdpa`` takes the row layout of the ``standard`` backend: the same attention with one unmasked causal call and
fewer copies (measured ~10% faster on CPU there).
"""

from __future__ import annotations

import torch

from zorro_verl.attention.base import Backend, always
from zorro_verl.attention.features import NO_FEATURES, AttentionFeatures, dense_attention, position_visible
from zorro_verl.attention.standard import attend_standard
from zorro_verl.packing import ZorroPlan
from zorro_verl.packing.segments import scatter_valid

__all__ = ["SDPA", "EAGER", "attend_reference", "dense_attention", "reference_index", "reference_window_masks"]


def _tokens_first(x: torch.Tensor) -> torch.Tensor:
    """``[1, H, T, D] -> [T, H, D]`` (a view)."""
    return x[0].transpose(0, 1)


# Layout moves between the packed row and the padded blocks of the two calls (prompt blocks [G, Pmax] and response
# blocks [B, Rmax] / [B, Pmax + Rmax]), as autograd Functions on 2-D rows [T, H*D] (row gathers on 2-D tensors
# are several times faster than on [T, H, D]) whose backward is one index_select / index_add per block — not
# autograd's generic slice/zeros/accumulating index_put per indexing op. Pad slots read row 0 in forward; their
# gradients go to a dummy row T and are dropped, which is exact: no valid output depends on a pad slot.
class _ToBlocks(torch.autograd.Function):
    """``x [T, F] -> (x[src_p] [Mp, F], x[src_r] [Mr, F])``; backward sums each slot's gradient into its row
    (``dst_*`` = ``src_*`` with pads -> ``T``). Used for queries (each token read once) and keys/values (a prompt
    token is read by its prompt block and by each of its group's response blocks)."""

    @staticmethod
    def forward(ctx, x, src_p, src_r, dst_p, dst_r):
        ctx.save_for_backward(dst_p, dst_r)
        ctx.T = x.shape[0]
        return x.index_select(0, src_p), x.index_select(0, src_r)

    @staticmethod
    def backward(ctx, dp, dr):
        dst_p, dst_r = ctx.saved_tensors
        ref = dp if dp is not None else dr
        dx = ref.new_zeros((ctx.T + 1, ref.shape[1]))
        if dp is not None:
            dx.index_add_(0, dst_p, dp)
        if dr is not None:
            dx.index_add_(0, dst_r, dr)
        return dx[:ctx.T], None, None, None, None


class _FromBlocks(torch.autograd.Function):
    """``(yp [Mp, F], yr [Mr, F]) -> x [T, F]``, each token from its valid slot (``out_index [T]`` into
    ``cat(yp, yr)``); backward gathers ``dx`` into the blocks with pad slots zeroed (a pad query's gradient must
    not reach any key)."""

    @staticmethod
    def forward(ctx, yp, yr, out_index, src_p, src_r, pad_p, pad_r):
        ctx.save_for_backward(src_p, src_r, pad_p, pad_r)
        return torch.cat([yp, yr]).index_select(0, out_index)

    @staticmethod
    def backward(ctx, dx):
        src_p, src_r, pad_p, pad_r = ctx.saved_tensors
        dp = dx.index_select(0, src_p).masked_fill_(pad_p[:, None], 0)
        dr = dx.index_select(0, src_r).masked_fill_(pad_r[:, None], 0)
        return dp, dr, None, None, None, None, None


def reference_index(plan: ZorroPlan) -> dict:
    """Index set of the reference backends (memoised in the plan under ``"reference"``; no host sync: masks, not
    positions). Slots of the prompt blocks ``[G*Pmax]``, of the response query blocks ``[B*Rmax]`` and of the
    response key blocks ``[B*(Pmax+Rmax)]`` (= per response ``[its prompt ; itself]``):

    * ``p_src``, ``r_src``, ``kv_src``: the packed row each slot reads (pads: 0); ``p_dst``, ``r_dst``, ``kv_dst``:
      the same with pads -> ``T`` (their gradients are dropped); ``p_pad``, ``r_pad``: the pad flags;
    * ``prompt_dims``: ``(G, Pmax)``; ``response_blocks``: per dense call of the response side ``(n, Lq, Lk)``
      (here one, ``(B, Rmax, Pmax + Rmax)``; none when no row has a response token), and ``response_masks``: per
      call ``[n, 1, Lq, Lk] bool`` — key ``j < P_g`` of the prompt slot, or own key ``k <= q``;
    * ``out_index [T]``: position of each packed token in ``cat(prompt slots, response query slots)``.

    A prefix-tree plan (``plan.tree``) gets the same index set over its nodes: roots take the prompt blocks, every
    other node a response block whose keys are ``[its ancestor chain ; itself]``, the nodes split into the blocks of
    ``plan.tree.child_buckets`` (nodes of similar length together, each block padded to its own longest node and
    chain).
    """
    if plan.tree is not None:
        return plan.memo.get("reference", lambda: _tree_index(plan))

    def build():
        dev = plan.device
        G, B, T, Pm, Rm = plan.G, plan.B, plan.T, plan.max_prompt_len, plan.max_response_len
        ar_p = torch.arange(Pm, device=dev)
        ar_r = torch.arange(Rm, device=dev)
        p_valid = ar_p[None, :] < plan.prompt_lens[:, None]  # [G, Pmax]
        r_valid = ar_r[None, :] < plan.response_lens[:, None]  # [B, Rmax]
        pi = torch.where(p_valid, plan.prompt_start[:, None] + ar_p[None, :], 0)  # [G, Pmax]
        ri = torch.where(r_valid, plan.response_start[:, None] + ar_r[None, :], 0)  # [B, Rmax]
        key_prompt = (ar_p[None, None, :] < plan.row_prompt_lens[:, None, None]).expand(B, Rm, Pm)
        key_own = (ar_r[None, :] <= ar_r[:, None])[None].expand(B, Rm, Rm)  # [B, Rmax(q), Rmax(k)]
        slots = torch.arange(G * Pm + B * Rm, device=dev)
        out_index = scatter_valid(T, torch.cat([pi.flatten(), ri.flatten()]),
                                  torch.cat([p_valid.flatten(), r_valid.flatten()]), slots)
        kv_src = torch.cat([pi[plan.row_group], ri], 1).flatten()  # [B*(Pmax+Rmax)]
        kv_valid = torch.cat([p_valid[plan.row_group], r_valid], 1).flatten()
        has_r = B * Rm > 0
        return {
            **_slots(T, pi, ri, p_valid, r_valid, kv_src, kv_valid),
            "prompt_dims": (G, Pm), "response_blocks": ((B, Rm, Pm + Rm),) if has_r else (),
            "response_masks": (torch.cat([key_prompt, key_own], dim=2)[:, None],) if has_r else (),  # [B,1,Rm,Pm+Rm]
            "out_index": out_index,
        }

    return plan.memo.get("reference", build)


def _slots(T: int, pi, ri, p_valid, r_valid, kv_src, kv_valid) -> dict:
    """The slot fields of :func:`reference_index` from the padded blocks' packed indices ``pi`` / ``ri`` (and their
    valid flags) and the response key blocks' ``kv_src`` / ``kv_valid`` (flat): sources, destinations (pads ->
    ``T``, gradients dropped) and pad flags."""
    p_src, r_src = pi.flatten(), ri.flatten()
    p_valid, r_valid = p_valid.flatten(), r_valid.flatten()
    return {"p_src": p_src, "p_dst": torch.where(p_valid, p_src, T), "p_pad": ~p_valid,
            "r_src": r_src, "r_dst": torch.where(r_valid, r_src, T), "r_pad": ~r_valid,
            "kv_src": kv_src, "kv_dst": torch.where(kv_valid, kv_src, T)}


def _tree_index(plan: ZorroPlan) -> dict:
    """:func:`reference_index` of a tree plan: prompt blocks = roots ``[nR, Lr]``; the other nodes in the blocks of
    ``tree.child_buckets``: per block of ``n`` nodes, queries ``[n, Lc]`` and keys ``[n, A + Lc]`` = ``[ancestor chain
    (A = the block's longest chain) ; itself]`` (``Lc`` = the block's longest node)."""
    from zorro_verl.packing.tree import tree_chains

    tree, ch = plan.tree, tree_chains(plan)
    dev, T = plan.device, plan.T
    nR, Lr = tree.num_roots, tree.max_root_len
    ar_p = torch.arange(Lr, device=dev)
    p_valid = ar_p[None, :] < tree.node_len[tree.roots][:, None]  # [nR, Lr]
    pi = torch.where(p_valid, tree.node_start[tree.roots][:, None] + ar_p[None, :], 0)
    ri, r_valid, kv_src, kv_valid, masks, blocks = [], [], [], [], [], []
    off = 0
    for n, Lc, A in tree.child_buckets:
        at = tree.child_order[off:off + n]  # [n] positions into tree.children
        off += n
        kids = tree.children[at]
        ar_r = torch.arange(Lc, device=dev)
        rv = ar_r[None, :] < tree.node_len[kids][:, None]  # [n, Lc]
        rix = torch.where(rv, tree.node_start[kids][:, None] + ar_r[None, :], 0)
        chain, chain_valid = ch["chain"][at, :A], ch["chain_valid"][at, :A]  # [n, A]
        ri.append(rix.flatten())
        r_valid.append(rv.flatten())
        kv_src.append(torch.cat([chain, rix], 1).flatten())  # [n*(A+Lc)]
        kv_valid.append(torch.cat([chain_valid, rv], 1).flatten())
        key_own = (ar_r[None, :] <= ar_r[:, None])[None].expand(n, Lc, Lc)  # [n, Lc(q), Lc(k)]
        masks.append(torch.cat([chain_valid[:, None, :].expand(n, Lc, A), key_own], dim=2)[:, None])  # [n,1,Lc,A+Lc]
        blocks.append((n, Lc, A + Lc))
    cat = lambda xs, dtype: torch.cat(xs) if xs else torch.zeros(0, dtype=dtype, device=dev)  # noqa: E731
    ri, r_valid = cat(ri, torch.long), cat(r_valid, torch.bool)
    kv_src, kv_valid = cat(kv_src, torch.long), cat(kv_valid, torch.bool)
    slots = torch.arange(nR * Lr + ri.numel(), device=dev)
    out_index = scatter_valid(T, torch.cat([pi.flatten(), ri]), torch.cat([p_valid.flatten(), r_valid]), slots)
    return {
        **_slots(T, pi, ri, p_valid, r_valid, kv_src, kv_valid),
        "prompt_dims": (nR, Lr), "response_blocks": tuple(blocks), "response_masks": tuple(masks),
        "out_index": out_index,
    }


def reference_window_masks(plan: ZorroPlan, window: int | None, chunk: int | None = None) -> tuple[torch.Tensor, tuple]:
    """The reference blocks' masks of a sliding-window or chunked layer (memoised per rule): ``(prompt [G, 1, Pmax,
    Pmax], response masks)`` bool, one ``[n, 1, Lq, Lk]`` per ``response_blocks`` call, = the split-attention rule
    and ``pos_q - pos_k < window`` / ``pos_q // chunk == pos_k // chunk`` on each slot's original position
    (``plan.position_ids``; pad slots read token 0, position 0, and still see a key: the block's first key slot is a
    valid token at position 0, inside every window and chunk of position 0)."""
    rule = (window, chunk)

    def build():
        lay = reference_index(plan)
        (G, Pm), pos = lay["prompt_dims"], plan.position_ids
        pp = pos[lay["p_src"]].view(G, Pm)  # [G, Pmax]
        causal = torch.ones(Pm, Pm, dtype=torch.bool, device=plan.device).tril()
        prompt = causal & position_visible(pp[:, :, None], pp[:, None, :], rule)
        resp, qo, ko = [], 0, 0
        for (n, Lq, Lk), mask in zip(lay["response_blocks"], lay["response_masks"]):
            qr = pos[lay["r_src"][qo:qo + n * Lq]].view(n, Lq)
            kr = pos[lay["kv_src"][ko:ko + n * Lk]].view(n, Lk)
            qo, ko = qo + n * Lq, ko + n * Lk
            resp.append((mask[:, 0] & position_visible(qr[:, :, None], kr[:, None, :], rule))[:, None])
        return prompt[:, None], tuple(resp)

    return plan.memo.get(("reference", "window", window) if chunk is None else ("reference", "rule", rule), build)


def attend_reference(plan: ZorroPlan, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     scaling: float, math: str = "sdpa", features: AttentionFeatures = NO_FEATURES) -> torch.Tensor:
    """Split attention in padded dense calls: the prompt blocks, then each response block (one; a tree plan's
    non-root nodes: one per block of ``child_buckets``). ``q [1, Hq, T, D]``, ``k/v [1, Hkv, T, D]`` ->
    ``[1, T, Hq, D]``.
    ``features``: a window / chunk becomes part of both calls' masks; sinks / soft-capping run the explicit math."""
    lay = reference_index(plan)
    rule = features.position_rule
    p_mask, r_masks = (None, lay["response_masks"]) if rule is None else reference_window_masks(plan, *rule)
    T, (G, Pm), blocks = plan.T, lay["prompt_dims"], lay["response_blocks"]
    Hq, Hkv, D = query.shape[1], key.shape[1], query.shape[3]
    rows = lambda x: _tokens_first(x).reshape(T, -1)  # noqa: E731  [1, H, T, D] -> [T, H*D] (a view if possible)
    p_src, p_dst, r_src, r_dst = lay["p_src"], lay["p_dst"], lay["r_src"], lay["r_dst"]

    qp, qr = _ToBlocks.apply(rows(query), p_src, r_src, p_dst, r_dst)  # [G*Pmax, Hq*D], [sum n*Lq, Hq*D]
    kp, kr = _ToBlocks.apply(rows(key), p_src, lay["kv_src"], p_dst, lay["kv_dst"])  # [.., Hkv*D]: r [sum n*Lk]
    vp, vr = _ToBlocks.apply(rows(value), p_src, lay["kv_src"], p_dst, lay["kv_dst"])
    blk = lambda x, n, L, H: x.view(n, L, H, D).transpose(1, 2)  # noqa: E731  [n*L, H*D] -> [n, H, L, D]
    out_p = dense_attention(blk(qp, G, Pm, Hq), blk(kp, G, Pm, Hkv), blk(vp, G, Pm, Hkv), scaling,
                            mask=p_mask, causal=p_mask is None, math=math, features=features)  # [G, Hq, Pmax, D]
    out_p = out_p.transpose(1, 2).reshape(G * Pm, Hq * D)
    if blocks:  # one dense call per block: [n, Hq, Lq, D] vs [n, Hkv, Lk, D]
        kv_sizes = [n * Lk for n, _, Lk in blocks]
        qs, ks, vs = qr.split([n * Lq for n, Lq, _ in blocks]), kr.split(kv_sizes), vr.split(kv_sizes)
        outs = [dense_attention(blk(q, n, Lq, Hq), blk(k, n, Lk, Hkv), blk(v, n, Lk, Hkv), scaling, mask=m,
                                math=math, features=features).transpose(1, 2).reshape(n * Lq, Hq * D)
                for (n, Lq, Lk), q, k, v, m in zip(blocks, qs, ks, vs, r_masks)]
        out_r = outs[0] if len(outs) == 1 else torch.cat(outs)
    else:  # no response token anywhere (tree: no non-root node): the response blocks are empty
        out_r = qr
    out = _FromBlocks.apply(out_p, out_r, lay["out_index"], p_src, r_src, lay["p_pad"], lay["r_pad"])  # [T, Hq*D]
    return out.view(1, T, Hq, D)


def _attend_sdpa(plan: ZorroPlan, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 scaling: float, features: AttentionFeatures = NO_FEATURES) -> torch.Tensor:
    if plan.G == plan.B:  # no shared prompt: the row layout is the same attention with one causal call
        return attend_standard(plan, query, key, value, scaling, features)
    return attend_reference(plan, query, key, value, scaling, math="sdpa", features=features)


def _attend_eager(plan: ZorroPlan, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  scaling: float, features: AttentionFeatures = NO_FEATURES) -> torch.Tensor:
    return attend_reference(plan, query, key, value, scaling, math="eager", features=features)


SDPA = Backend("sdpa", _attend_sdpa, reference_index, always,
               "reference: two padded SDPA calls (prompt blocks, responses vs [prompt ; itself]); any device/dtype")
EAGER = Backend("eager", _attend_eager, reference_index, always,
                "reference with explicit matmul/softmax (fp64 kept in fp64); any device/dtype")
