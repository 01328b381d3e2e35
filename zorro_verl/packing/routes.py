"""Per-token MoE routes (router replay) on the packed row: a deduplicated prompt token carries one route, so the
recorded routes of every copy of it must agree (docs/design/megatron.md, router replay). Imports torch only.

verl's router replay (``router_replay.mode`` R2 / R3) hands ``routed_experts``: for every token of every ordinary
row, the top-k experts each MoE layer chose (``[..., layers, topk]``), recorded by an earlier forward (R2) or by the
rollout engine (R3), and megatron's routers then use those instead of their own top-k. On the packed row a prompt
token stands for its ``n`` copies (one per row of its group, or per row sharing the prefix): the replay is exact
only when the copies were routed alike, which holds for R2 records of the ordinary forward (routing is token-wise)
but not necessarily for rollout routes (R3: another engine, another batch composition, its own numerics).
"""

from __future__ import annotations

from typing import Optional

import torch

from zorro_verl.packing.plan import ZorroPlan

__all__ = ["packed_routes"]


def packed_routes(plan: ZorroPlan, routes: torch.Tensor,
                  replay_mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The routes of the packed row, checked: every copy of a packed token must carry the same routes.

    Args:
        plan: the micro-batch's plan (prompt or prefix sharing).
        routes: ``[B, S, *route]`` integer expert ids in the plan's padded layout (the ``[B, S]`` of the
            ``input_ids`` the plan was built from; pads are ignored), e.g. ``[B, S, layers, topk]``.
        replay_mask: optional ``[B, S] bool``: the tokens whose routes are replayed (verl's R3 mask: all but each
            row's last token); the others keep the router's own choice. Copies of a packed token must agree on it
            too.

    Returns:
        ``(routes [T, *route], mask [T] bool | None)``: each packed token's routes (a prompt token's from its group's
        first row) and its replay flag.

    Raises:
        ValueError naming router replay, the disagreeing groups and the first disagreeing row / column, when two
        copies of a packed token carry different routes (or replay flags). One host sync (the check), at plan time.
    """
    B, S = plan.B, plan.S
    if routes.dim() < 2 or tuple(routes.shape[:2]) != (B, S):
        raise ValueError(f"routes: expected [B={B}, S={S}, ...] (the plan's padded layout), got {tuple(routes.shape)}.")
    if replay_mask is not None and (replay_mask.shape != (B, S) or replay_mask.dtype != torch.bool):
        raise ValueError(f"replay_mask: expected [B={B}, S={S}] bool, got {tuple(replay_mask.shape)} "
                         f"{replay_mask.dtype}.")
    flat = routes.reshape(B * S, *routes.shape[2:])
    packed = flat[plan.source_index]  # [T, *route]
    fi = plan.full_index()  # [B, S]: the packed token each batch token is a copy of, -1 on pads
    valid = fi >= 0
    at = fi.clamp(min=0)
    # a copy disagrees when its routes differ from the packed token's (only where it is replayed, with a mask)
    differ = (routes != packed[at]).reshape(B, S, -1).any(-1)
    mask = None
    if replay_mask is not None:
        mask = replay_mask.reshape(-1)[plan.source_index]
        bad = valid & ((replay_mask != mask[at]) | (replay_mask & differ))
    else:
        bad = valid & differ
    if bool(bad.any()):  # the one host sync
        rows = bad.any(1).nonzero()[:, 0]
        b = int(rows[0])
        s = int(bad[b].nonzero()[0, 0])
        groups = sorted({int(g) for g in plan.row_group[rows].tolist()})
        raise ValueError(
            f"router replay: the recorded routes (routed_experts) of a deduplicated prompt token differ between the "
            f"rows of its group(s) {groups[:8]}{' ...' if len(groups) > 8 else ''} (first: row {b}, column {s}, "
            f"expected the routes of row {int(plan.source_index[fi[b, s]]) // S}): the packed row computes that "
            "token once and can replay only one route for it. Expected identical routes for every copy of a prompt "
            "token (R2 records of the ordinary forward are); turn zorro off for this batch (on_unsupported=warn) "
            "or router replay off (router_replay.mode=disabled).")
    return packed, mask
