"""Backend ``flex``: FlexAttention split attention, one call on the packed row with a block mask built from the
plan (docs/DESIGN.md §2).

``mask(q, kv) = kv <= q  &  group[q] == group[kv]  &  (is_prompt[kv] | segment[q] == segment[kv])``

(prefix-tree plans: ``kv <= q & q < sub_end[kv]``, the packed end of the subtree of ``kv``'s node).

(for a response query every prompt key of its group precedes it, so ``kv <= q`` keeps "all of the prompt").
On CUDA the kernel is compiled once per process; on CPU flex runs its unfused forward only (no backward there,
so ``available`` is False on CPU; the forward still runs for tests).
"""

from __future__ import annotations

import torch

from zorro_verl.attention.base import Backend
from zorro_verl.packing import ZorroPlan

__all__ = ["BACKEND", "attend_flex", "block_mask_for"]

_COMPILED = None


def block_mask_for(plan: ZorroPlan):
    """The plan's ``BlockMask`` over ``[T, T]`` (memoised in the plan under ``"flex"``)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def build():
        if plan.tree is not None:  # DFS layout: a key's node subtree is [its start, sub_end): kv visible to those q
            sub_end = plan.tree.node_sub_end[plan.tree.token_node]  # [T]

            def tree_mod(b, h, q_idx, kv_idx):
                return (kv_idx <= q_idx) & (q_idx < sub_end[kv_idx])

            return create_block_mask(tree_mod, None, None, plan.T, plan.T, device=plan.device)
        group, seg, is_prompt = plan.token_layout()

        def mask_mod(b, h, q_idx, kv_idx):
            same_group = group[q_idx] == group[kv_idx]
            visible = is_prompt[kv_idx] | (seg[q_idx] == seg[kv_idx])
            return (kv_idx <= q_idx) & same_group & visible

        return create_block_mask(mask_mod, None, None, plan.T, plan.T, device=plan.device)

    return plan.memo.get("flex", build)


def _flex(device: torch.device):
    """Compiled flex_attention on CUDA (compiled once per process), the unfused eager one on CPU."""
    global _COMPILED
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    if _COMPILED is None:
        _COMPILED = torch.compile(flex_attention, dynamic=False)
    return _COMPILED


def attend_flex(plan: ZorroPlan, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                scaling: float) -> torch.Tensor:
    """``q [1, Hq, T, D]``, ``k/v [1, Hkv, T, D]`` -> ``[1, T, Hq, D]``."""
    if query.device.type == "cpu" and (query.requires_grad or key.requires_grad or value.requires_grad):
        raise ValueError("attention backend 'flex': FlexAttention has no backward on CPU. Use attention backend "
                         "'sdpa' (attn_implementation='sdpa') for training on CPU, or run flex on CUDA.")
    out = _flex(query.device)(query, key, value, block_mask=block_mask_for(plan), scale=scaling,
             enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2)



def _available(device: torch.device) -> bool:
    if torch.device(device).type != "cuda":
        return False  # forward only on CPU
    import importlib.util

    return importlib.util.find_spec("torch.nn.attention.flex_attention") is not None


BACKEND = Backend("flex", attend_flex, block_mask_for, _available,
                  "FlexAttention with a block mask from the plan (compiled once on CUDA; CPU: forward only)")
