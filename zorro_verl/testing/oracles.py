"""Reference computations zorro is checked against: the ordinary per-row and batched model forwards, and the dense
(O(T^2)) attention mask and attention of a plan's packed row. Tests and tiny batches only."""

from __future__ import annotations

import torch

__all__ = ["ordinary_logprobs", "ordinary_logprobs_padded", "dense_mask", "dense_attention_oracle"]


def ordinary_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_width: int, *,
                      temperature: float = 1.0, calculate_entropy: bool = False):
    """The ordinary per-row forward (the oracle): each row's valid tokens alone, full logits, log-softmax.

    Returns ``(log_probs [N], entropy [N] | None)`` over valid response tokens in original row order.
    """
    B, S = input_ids.shape
    Pw = S - response_width
    lps, ents = [], []
    for b in range(B):
        valid = attention_mask[b].bool()
        p = int(valid[:Pw].sum())
        r = int(valid[Pw:].sum())
        if r == 0:
            continue
        x = input_ids[b][valid][None]
        logits = model(input_ids=x, use_cache=False).logits[0, p - 1:p + r - 1]
        logits = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32) / temperature
        logp = torch.log_softmax(logits, -1)
        lps.append(logp.gather(-1, x[0, p:p + r, None]).squeeze(-1))
        if calculate_entropy:
            ents.append(-(logp.exp() * logp).sum(-1))
    empty = torch.zeros(0, dtype=torch.float64 if model.dtype == torch.float64 else torch.float32,
                        device=input_ids.device)
    lp = torch.cat(lps) if lps else empty
    ent = (torch.cat(ents) if ents else empty) if calculate_entropy else None
    return lp, ent


def ordinary_logprobs_padded(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                             position_ids: torch.Tensor, response_width: int, *, temperature: float = 1.0,
                             calculate_entropy: bool = False):
    """The ordinary *batched* forward as verl runs it (padded rows, attention mask, full logits) — the
    benchmark's "full logits" baseline. Returns ``[B, R]`` log-probs (and entropy)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   use_cache=False).logits
    logits = logits[:, -response_width - 1:-1]
    logits = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32) / temperature
    logp = torch.log_softmax(logits, -1)
    lp = logp.gather(-1, input_ids[:, -response_width:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1) if calculate_entropy else None
    return lp, ent


def _excl_cumsum(x: torch.Tensor) -> torch.Tensor:
    """``[n] -> [n]``: ``out[i] = sum(x[:i])``."""
    return torch.cumsum(x, 0) - x


def dense_mask(plan, window: int | None = None, chunk: int | None = None) -> torch.Tensor:
    """The full attention mask of a plan's packed row. O(T^2): tests and tiny batches only.

    Uses the plan's core fields only: ``T``, ``G``, ``B``, ``row_group [B]``, ``prompt_start [G]``,
    ``prompt_lens [G]``, ``response_start [B]``, ``response_lens [B]`` (int64, packed-row coordinates) and, with a
    ``window``, each token's original position recomputed from those segments (a prompt token's index in its prompt;
    a response token's ``P_g`` + its index in the response) — not ``plan.position_ids``, which the backends read.

    Returns:
        ``[T, T] bool``: ``mask[q, k]`` is True iff ``k <= q``, ``q`` and ``k`` belong to the same group, ``k``
        is a prompt token or lies in ``q``'s own segment (its prompt, or its own response), and (with a window)
        ``pos[q] - pos[k] < window`` (transformers' sliding-window rule), (with a ``chunk``)
        ``pos[q] // chunk == pos[k] // chunk`` (transformers' ``chunked_overlay``, Llama 4).

    Raises:
        ValueError: the prompt and response segments do not tile ``[0, T)`` exactly once.
    """
    if getattr(plan, "tree", None) is not None:
        return _tree_dense_mask(plan, window, chunk)
    T, G, B = int(plan.T), int(plan.G), int(plan.B)
    dev = plan.prompt_start.device
    # Segments 0..G-1 are the prompts, G..G+B-1 the responses (of rows 0..B-1).
    starts = torch.cat([plan.prompt_start, plan.response_start]).long()
    lens = torch.cat([plan.prompt_lens, plan.response_lens]).long()
    seg_group = torch.cat([torch.arange(G, device=dev), plan.row_group.long()])
    total = int(lens.sum())
    seg_of = torch.repeat_interleave(torch.arange(G + B, device=dev), lens, output_size=total)  # [total]
    tok = starts[seg_of] + torch.arange(total, device=dev) - _excl_cumsum(lens)[seg_of]  # packed index per token
    # An oracle must not silently paper over a malformed plan: every packed position belongs to exactly one segment.
    in_range = total == T and not bool(((tok < 0) | (tok >= T)).any())
    if not in_range or bool((torch.bincount(tok, minlength=T) != 1).any()):
        raise ValueError(f"plan: expected its prompt and response segments to tile the packed row [0, T={T}) exactly "
                         f"once, got {total} segment tokens at positions {sorted(set(tok.tolist()))[:8]}... Pass a "
                         "plan from zorro_verl.packing.build_plan.")
    seg = torch.empty(T, dtype=torch.long, device=dev)
    seg[tok] = seg_of
    group = seg_group[seg]
    is_prompt = seg < G
    ar = torch.arange(T, device=dev)
    causal = ar[None, :] <= ar[:, None]
    same_group = group[:, None] == group[None, :]
    visible = is_prompt[None, :] | (seg[:, None] == seg[None, :])  # key is a prompt token, or in q's own segment
    mask = causal & same_group & visible
    if window is not None or chunk is not None:
        seg_pos0 = torch.cat([torch.zeros(G, dtype=torch.long, device=dev), plan.prompt_lens.long()[plan.row_group]])
        pos = torch.empty(T, dtype=torch.long, device=dev)
        pos[tok] = seg_pos0[seg_of] + torch.arange(total, device=dev) - _excl_cumsum(lens)[seg_of]
        mask = _position_rule(mask, pos, window, chunk)
    return mask


def _position_rule(mask: torch.Tensor, pos: torch.Tensor, window: int | None, chunk: int | None) -> torch.Tensor:
    """``mask [T, T]`` and the window / chunk rule on the packed tokens' row positions ``pos [T]``."""
    if window is not None:
        mask = mask & (pos[:, None] - pos[None, :] < window)
    if chunk is not None:
        mask = mask & (pos[:, None] // chunk == pos[None, :] // chunk)
    return mask


def _tree_dense_mask(plan, window: int | None = None, chunk: int | None = None) -> torch.Tensor:
    """:func:`dense_mask` of a prefix-tree plan from its ancestor table: ``mask[q, k]`` iff ``k``'s node is an
    ancestor of ``q``'s node, or the same node and ``k <= q`` (and ``pos_q - pos_k < window``: a node's positions
    continue from its ancestors). The nodes must tile ``[0, T)`` exactly once."""
    tree, T = plan.tree, int(plan.T)
    dev = tree.node_start.device
    starts, lens = tree.node_start.long(), tree.node_len.long()
    total = int(lens.sum())
    seg_of = torch.repeat_interleave(torch.arange(lens.numel(), device=dev), lens, output_size=total)
    tok = starts[seg_of] + torch.arange(total, device=dev) - _excl_cumsum(lens)[seg_of]
    if total != T or bool((torch.bincount(tok, minlength=T) != 1).any()):
        raise ValueError(f"plan: expected its tree nodes to tile the packed row [0, T={T}) exactly once, got {total} "
                         "node tokens. Pass a plan from zorro_verl.packing.build_plan(..., sharing='prefix').")
    node = torch.empty(T, dtype=torch.long, device=dev)
    node[tok] = seg_of
    depth = tree.node_depth[node]  # [T]
    anc_q = tree.node_anc[node]  # [T, levels]: q's ancestor at each depth
    is_anc = anc_q.gather(1, depth[None, :].expand(T, T)) == node[None, :]  # [q, k]: k's node on q's path
    ar = torch.arange(T, device=dev)
    same = node[:, None] == node[None, :]
    mask = is_anc & (~same | (ar[None, :] <= ar[:, None]))
    if window is not None or chunk is not None:
        pos = tree.node_pos0[node] + ar - starts[node]  # [T] position of each packed token in its rows
        mask = _position_rule(mask, pos, window, chunk)
    return mask



def dense_attention_oracle(plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, *,
                           window: int | None = None, sinks: torch.Tensor | None = None,
                           softcap: float | None = None, chunk: int | None = None) -> torch.Tensor:
    """``softmax(cap(q k^T * scaling), masked by dense_mask(plan, window, chunk), with the sinks) v`` over the whole
    packed row. O(T^2), tests only.

    Args:
        plan: a :class:`~zorro_verl.packing.ZorroPlan` (see :func:`dense_mask`).
        q: ``[1, Hq, T, D]``; k, v: ``[1, Hkv, T, D]`` with ``Hq % Hkv == 0`` (GQA: each key head serves
            ``Hq // Hkv`` consecutive query heads). Any float dtype; the result keeps it (fp64 stays fp64).
        scaling: the softmax scale (``1 / sqrt(D)`` for most models).
        window: sliding window (``pos_q - pos_k < window``), or None.
        sinks: ``[Hq]`` sink logits (gpt-oss): an extra softmax column per head with no value, or None.
        softcap: ``c`` (Gemma 2): scores ``c * tanh(scores / c)`` before the mask, or None.
        chunk: chunked attention (``pos_q // chunk == pos_k // chunk``, Llama 4), or None.

    Returns:
        ``[1, T, Hq, D]`` in ``q``'s dtype (the layout attention functions return).
    """
    T = int(plan.T)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or q.shape[0] != 1 or q.shape[2] != T \
            or k.shape != v.shape or k.shape[0] != 1 or k.shape[2] != T or k.shape[3] != q.shape[3]:
        raise ValueError(f"q, k, v: expected [1, Hq, T={T}, D] and two [1, Hkv, T, D], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}. Pass the packed row's heads-first tensors.")
    hq, hkv = q.shape[1], k.shape[1]
    if hq % hkv:
        raise ValueError(f"q, k: expected the query heads ({hq}) to be a multiple of the key heads ({hkv}).")
    k = k.repeat_interleave(hq // hkv, 1)
    v = v.repeat_interleave(hq // hkv, 1)
    s = (q @ k.transpose(-1, -2)) * scaling
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~dense_mask(plan, window, chunk).to(q.device), float("-inf"))  # every token sees itself
    if sinks is None:
        return (torch.softmax(s, -1) @ v).transpose(1, 2)
    col = sinks.to(s.dtype).view(1, hq, 1, 1).expand(1, hq, T, 1)
    return (torch.softmax(torch.cat([s, col], -1), -1)[..., :-1] @ v).transpose(1, 2)
