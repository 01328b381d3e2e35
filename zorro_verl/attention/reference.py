"""Reference split attention: two dense calls on padded per-group / per-response blocks (CPU and GPU, any dtype).

::

    call 1 (prompts):   [G, Hq, Pmax, D]  causal; right padding is harmless under a causal mask
    call 2 (responses): q [B, Hq, Rmax, D]  vs  k/v [B, Hkv, Pmax + Rmax, D] = [prompt of its group ; itself]
                        mask: prompt key j < P_g, own key k <= q

Memory is ``O(G Pmax^2 + B Rmax (Pmax + Rmax))`` scores — never ``T^2`` over the micro-batch. The gather
``k_prompt[row_group]`` sums the n responses' gradients into the single prompt copy.

``math="sdpa"`` uses ``torch.nn.functional.scaled_dot_product_attention``; ``math="eager"`` is explicit
matmul/softmax that keeps fp64 in fp64 (transformers' own eager path upcasts to fp32 only, losing fp64).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zorro_verl.packing import ZorroPlan

__all__ = ["attend_reference", "attend_standard", "dense_attention"]


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, *,
                    mask: torch.Tensor | None = None, causal: bool = False, math: str = "sdpa") -> torch.Tensor:
    """Batched attention. ``q [n, Hq, Lq, D]``, ``k/v [n, Hkv, Lk, D]``, ``mask`` bool broadcastable to
    ``[n, Hq, Lq, Lk]`` (True = attend) or ``causal`` (top-left aligned, only for ``Lq == Lk``) -> ``[n, Hq, Lq, D]``.
    """
    hq, hkv = q.shape[1], k.shape[1]
    if math == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                              scale=scaling, enable_gqa=hq != hkv)
    if hq != hkv:  # repeat_kv semantics: kv head j serves q heads [j*n_rep, (j+1)*n_rep)
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scaling  # [n, Hq, Lq, Lk]
    if causal and mask is None:
        lq, lk = q.shape[2], k.shape[2]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    # Half precisions take the softmax in fp32 (as every production kernel does); fp32/fp64 stay as they are.
    sm_dtype = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    probs = torch.softmax(scores.to(sm_dtype), dim=-1).to(q.dtype)
    return torch.matmul(probs, v)


def _tokens_first(x: torch.Tensor) -> torch.Tensor:
    """``[1, H, T, D] -> [T, H, D]`` (a view)."""
    return x[0].transpose(0, 1)


def attend_reference(plan: ZorroPlan, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     scaling: float, math: str = "sdpa") -> torch.Tensor:
    """Split attention, two padded dense calls. ``q [1, Hq, T, D]``, ``k/v [1, Hkv, T, D]`` -> ``[1, T, Hq, D]``."""
    idx = plan.padded_index()
    q, k, v = _tokens_first(query), _tokens_first(key), _tokens_first(value)  # [T, H, D]
    G, B = plan.G, plan.B

    pi = idx["prompt_index"]  # [G, Pmax]
    qp = q[pi].transpose(1, 2)  # [G, Hq, Pmax, D]
    kp = k[pi].transpose(1, 2)  # [G, Hkv, Pmax, D]
    vp = v[pi].transpose(1, 2)
    out_p = dense_attention(qp, kp, vp, scaling, causal=True, math=math)  # [G, Hq, Pmax, D]
    parts = [out_p.transpose(1, 2).reshape(-1, q.shape[1], q.shape[2])]  # [G*Pmax, Hq, D]

    if plan.N > 0:
        ri = idx["response_index"]  # [B, Rmax]
        qr = q[ri].transpose(1, 2)  # [B, Hq, Rmax, D]
        kr = torch.cat([kp[plan.row_group], k[ri].transpose(1, 2)], dim=2)  # [B, Hkv, Pmax+Rmax, D]
        vr = torch.cat([vp[plan.row_group], v[ri].transpose(1, 2)], dim=2)
        out_r = dense_attention(qr, kr, vr, scaling, mask=idx["response_mask"], math=math)  # [B, Hq, Rmax, D]
        parts.append(out_r.transpose(1, 2).reshape(-1, q.shape[1], q.shape[2]))  # [B*Rmax, Hq, D]
    del G, B
    out = torch.cat(parts, 0)[idx["out_index"]]  # [T, Hq, D]
    return out.unsqueeze(0)


def attend_standard(plan: ZorroPlan, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    scaling: float) -> torch.Tensor:
    """"Standard QKV" mode: Q/K/V projected on dedup tokens, expanded to full rows ``[B, Lmax]``, one ordinary
    causal call (SDPA). ``q [1, Hq, T, D]``, ``k/v [1, Hkv, T, D]`` -> ``[1, T, Hq, D]``."""
    idx = plan.row_index()
    q, k, v = _tokens_first(query), _tokens_first(key), _tokens_first(value)
    ri = idx["row_index"]  # [B, Lmax]
    out = dense_attention(q[ri].transpose(1, 2), k[ri].transpose(1, 2), v[ri].transpose(1, 2), scaling,
                          causal=True, math="sdpa")  # [B, Hq, Lmax, D]
    out = out.transpose(1, 2).reshape(-1, q.shape[1], q.shape[2])[idx["out_index"]]  # [T, Hq, D]
    return out.unsqueeze(0)
