"""Backend ``flex``: FlexAttention split attention, one call on the packed row with a block mask built from the
plan (docs/design/attention.md).

``mask(q, kv) = kv <= q  &  group[q] == group[kv]  &  (is_prompt[kv] | segment[q] == segment[kv])``
(``& pos[q] - pos[kv] < W`` in a sliding-window layer, ``& pos[q] // C == pos[kv] // C`` in a chunked one)

(prefix-tree plans: ``kv <= q & q < sub_end[kv]``, the packed end of the subtree of ``kv``'s node).

(for a response query every prompt key of its group precedes it, so ``kv <= q`` keeps "all of the prompt").
On CUDA the kernel is compiled once per process; on CPU flex runs its unfused forward only (no backward there,
so ``available`` is False on CPU; the forward still runs for tests).
"""

from __future__ import annotations

from typing import Optional

import torch

from zorro_verl.attention.base import Backend
from zorro_verl.attention.features import NO_FEATURES, AttentionFeatures
from zorro_verl.packing import ZorroPlan

__all__ = ["BACKEND", "attend_flex", "block_mask_for"]

_COMPILED = None


def block_mask_for(plan: ZorroPlan, window: Optional[int] = None, chunk: Optional[int] = None):
    """The plan's ``BlockMask`` over ``[T, T]`` (memoised in the plan under ``"flex"``, one per window / chunk); a
    window adds ``pos[q] - pos[kv] < window``, a chunk ``pos[q] // chunk == pos[kv] // chunk`` on the original
    positions (``plan.position_ids``)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def rule(keep, pos, q_idx, kv_idx):
        if window is not None:
            keep = keep & (pos[q_idx] - pos[kv_idx] < window)
        if chunk is not None:
            keep = keep & (pos[q_idx] // chunk == pos[kv_idx] // chunk)
        return keep

    def build():
        if plan.tree is not None:  # DFS layout: a key's node subtree is [its start, sub_end): kv visible to those q
            sub_end = plan.tree.node_sub_end[plan.tree.token_node]  # [T]
            tpos = plan.position_ids

            def tree_mod(b, h, q_idx, kv_idx):
                keep = (kv_idx <= q_idx) & (q_idx < sub_end[kv_idx])
                return rule(keep, tpos, q_idx, kv_idx)

            return create_block_mask(tree_mod, None, None, plan.T, plan.T, device=plan.device)
        group, seg, is_prompt = plan.token_layout()
        pos = plan.position_ids

        def mask_mod(b, h, q_idx, kv_idx):
            same_group = group[q_idx] == group[kv_idx]
            visible = is_prompt[kv_idx] | (seg[q_idx] == seg[kv_idx])
            keep = (kv_idx <= q_idx) & same_group & visible
            return rule(keep, pos, q_idx, kv_idx)

        return create_block_mask(mask_mod, None, None, plan.T, plan.T, device=plan.device)

    key = "flex" if window is None and chunk is None else ("flex", window) if chunk is None else ("flex", window, chunk)
    return plan.memo.get(key, build)


_SCORE_MODS: dict = {}


def _softcap_mod(cap: float):
    """``score_mod`` of a soft-cap, one function object per value: the compiled kernel guards on the function, so a
    fresh closure per layer call would recompile it every call."""
    if cap not in _SCORE_MODS:
        def mod(score, b, h, q_idx, kv_idx):
            return torch.tanh(score / cap) * cap

        _SCORE_MODS[cap] = mod
    return _SCORE_MODS[cap]


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
                scaling: float, features: AttentionFeatures = NO_FEATURES) -> torch.Tensor:
    """``q [1, Hq, T, D]``, ``k/v [1, Hkv, T, D]`` -> ``[1, T, Hq, D]``. ``features``: the window / chunk in the
    block mask, soft-capping as a ``score_mod``, the sinks merged into flex's returned log-sum-exp."""
    sinks = features.sinks
    if query.device.type == "cpu" and (query.requires_grad or key.requires_grad or value.requires_grad
                                       or (sinks is not None and sinks.requires_grad and torch.is_grad_enabled())):
        raise ValueError("attention backend 'flex': FlexAttention has no backward on CPU. Use attention backend "
                         "'sdpa' (attn_implementation='sdpa') for training on CPU, or run flex on CUDA.")
    score_mod = None if features.softcap is None else _softcap_mod(features.softcap)
    kw = {}
    if sinks is not None:  # the log-sum-exp (natural log): return_aux from torch 2.9 on, return_lse before
        from torch.nn.attention import flex_attention as fa

        kw = {"return_aux": fa.AuxRequest(lse=True)} if hasattr(fa, "AuxRequest") else {"return_lse": True}
    out = _flex(query.device)(query, key, value, score_mod=score_mod,
                              block_mask=block_mask_for(plan, features.window, features.chunk), scale=scaling,
                              enable_gqa=query.shape[1] != key.shape[1], **kw)
    if sinks is None:
        return out.transpose(1, 2)
    out, aux = out  # [1, Hq, T, D], lse [1, Hq, T]
    lse = aux.lse if hasattr(aux, "lse") else aux
    lse2 = torch.logaddexp(lse, sinks.to(lse.dtype)[None, :, None])  # the sink once per query, differentiable
    return (out * torch.exp(lse - lse2)[..., None].to(out.dtype)).transpose(1, 2)



def _available(device: torch.device) -> bool:
    if torch.device(device).type != "cuda":
        return False  # forward only on CPU
    import importlib.util

    return importlib.util.find_spec("torch.nn.attention.flex_attention") is not None


BACKEND = Backend("flex", attend_flex, block_mask_for, _available,
                  "FlexAttention with a block mask from the plan (compiled once on CUDA; CPU: forward only)")
