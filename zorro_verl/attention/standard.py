"""Backend ``standard`` ("standard QKV", the API's ``use_split_attention=False``): Q/K/V are projected on the
deduplicated tokens, then expanded to full rows ``[B, Lmax]`` (each row's prompt copied from its group) for one
ordinary causal SDPA call; outputs are read back at each packed token's first occurrence. Exact, but the attention
itself is not deduplicated (docs/design/attention.md).
"""

from __future__ import annotations

import torch

from zorro_verl.attention.base import Backend, always
from zorro_verl.attention.features import NO_FEATURES, AttentionFeatures, dense_attention, position_visible
from zorro_verl.packing import ZorroPlan
from zorro_verl.packing.segments import scatter_valid

__all__ = ["BACKEND", "attend_standard", "row_index"]


def row_index(plan: ZorroPlan) -> dict:
    """Index set of the row layout (memoised in the plan under ``"standard"``).

    * ``row_index [B, Lmax]``: packed position of token ``l`` of row ``b``'s full sequence ``[prompt | response]``
      (0 on pads; right padded so an ordinary causal mask never lets a valid query see a pad);
    * ``out_index [T]``: for each packed token its place in ``[B * Lmax]`` (prompt tokens read from the group's
      first row). Tree plans: row ``b``'s token at depth ``l`` is read along its root path; a packed token is read
    from its node's representative row.
    """

    def build():
        if plan.tree is not None:
            return _tree_build()
        dev = plan.device
        Lm = plan.max_row_len
        ar = torch.arange(Lm, device=dev)[None, :]  # [1, Lmax]
        p = plan.row_prompt_lens[:, None]
        r = plan.response_lens[:, None]
        pstart = plan.prompt_start[plan.row_group][:, None]
        idx = torch.where(ar < p, pstart + ar, plan.response_start[:, None] + ar - p)
        valid = ar < p + r
        idx = torch.where(valid, idx, 0)
        flat = torch.arange(plan.B * Lm, device=dev).view(plan.B, Lm)
        # Responses from every row; prompt tokens only from the group's first row.
        rep = plan.group_rep_row[plan.row_group] == torch.arange(plan.B, device=dev)  # [B]
        take = valid & ((ar >= p) | rep[:, None])
        out_index = scatter_valid(plan.T, idx, take, flat)
        return {"row_index": idx, "out_index": out_index}

    def _tree_build():
        from zorro_verl.packing.tree import path_index

        tree, Lm = plan.tree, plan.max_row_len
        ar = torch.arange(Lm, device=plan.device)[None, :]
        L = (plan.row_prompt_lens + plan.response_lens)[:, None]  # [B, 1]
        valid = ar < L
        idx = path_index(tree, tree.row_node, torch.minimum(ar, L - 1).expand(plan.B, Lm))
        out_index = tree.node_rep_row[tree.token_node] * Lm + plan.position_ids  # [T]
        return {"row_index": torch.where(valid, idx, 0), "out_index": out_index}

    return plan.memo.get("standard", build)


def row_window_mask(plan: ZorroPlan, window: int | None, chunk: int | None = None) -> torch.Tensor:
    """``[B, 1, Lmax, Lmax] bool`` of a sliding-window or chunked layer in the row layout (memoised per rule): causal
    and ``pos_q - pos_k < window`` / ``pos_q // chunk == pos_k // chunk`` on the original positions (pad slots read
    token 0; a valid query never sees one)."""
    rule = (window, chunk)

    def build():
        pos = plan.position_ids[row_index(plan)["row_index"]]  # [B, Lmax]
        Lm = plan.max_row_len
        causal = torch.ones(Lm, Lm, dtype=torch.bool, device=plan.device).tril()
        return (causal & position_visible(pos[:, :, None], pos[:, None, :], rule))[:, None]

    return plan.memo.get(("standard", "window", window) if chunk is None else ("standard", "rule", rule), build)


def attend_standard(plan: ZorroPlan, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    scaling: float, features: AttentionFeatures = NO_FEATURES) -> torch.Tensor:
    """``q [1, Hq, T, D]``, ``k/v [1, Hkv, T, D]`` -> ``[1, T, Hq, D]`` (``features``: window / chunk as a mask over
    the rows' original positions; sinks / soft-capping by :func:`~zorro_verl.attention.features.dense_attention`)."""
    idx = row_index(plan)
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, H, D]
    ri = idx["row_index"]  # [B, Lmax]
    rule = features.position_rule
    mask = None if rule is None else row_window_mask(plan, *rule)
    out = dense_attention(q[ri].transpose(1, 2), k[ri].transpose(1, 2), v[ri].transpose(1, 2), scaling,
                          mask=mask, causal=mask is None, features=features)  # [B, Hq, Lmax, D]
    out = out.transpose(1, 2).reshape(-1, q.shape[1], q.shape[2])[idx["out_index"]]  # [T, Hq, D]
    return out.unsqueeze(0)


BACKEND = Backend("standard", attend_standard, row_index, always,
                  "K/V expanded to full rows, one ordinary causal SDPA call (dedup projections only)")
