"""flash-attn varlen split attention (GPU), the two-call gather design of DESIGN §2.

::

    call 1: prompts      q/k/v[prompt_token_index]   cu_seqlens over unique prompts, causal
    call 2: responses    q[resp_q_index] vs k/v[resp_kv_index] = per response [its prompt ; itself],
                         causal=True — flash-attn >= 2.1 aligns the causal mask bottom-right when
                         seqlen_k > seqlen_q, which is exactly "all of the prompt + own prefix".

The gather of prompt K/V per response is differentiable (index backward sums into the one prompt copy).
flash-attn is imported here, lazily; its absence raises an ImportError naming the ``flash`` extra.
"""

from __future__ import annotations

import torch

from zorro_verl.packing import ZorroPlan

__all__ = ["attend_varlen", "load_flash_varlen"]

_FLASH_FN = None


def load_flash_varlen():
    """Return ``flash_attn_varlen_func`` from flash-attn 3 (``flash_attn_interface``) or 2 (``flash_attn``)."""
    global _FLASH_FN
    if _FLASH_FN is None:
        try:
            from flash_attn_interface import flash_attn_varlen_func  # flash-attn 3 (Hopper)
        except ImportError:
            try:
                from flash_attn import flash_attn_varlen_func
            except ImportError as e:
                raise ImportError(
                    "attention backend 'flash' needs flash-attn: install the extra `pip install zorro-verl[flash]` "
                    "(CUDA only), or choose attn_implementation='sdpa' / 'flex_attention'.") from e
        _FLASH_FN = flash_attn_varlen_func
    return _FLASH_FN


def _call(fn, q, k, v, cu_q, cu_k, max_q, max_k, scaling):
    out = fn(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scaling, causal=True)
    return out[0] if isinstance(out, tuple) else out  # flash-attn 3 may return (out, lse)


def attend_varlen(plan: ZorroPlan, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  scaling: float) -> torch.Tensor:
    """``q [1, Hq, T, D]``, ``k/v [1, Hkv, T, D]`` (fp16/bf16, CUDA) -> ``[1, T, Hq, D]``."""
    if query.device.type != "cuda" or query.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"attention backend 'flash': expected fp16/bf16 CUDA tensors, got {query.dtype} on "
                         f"{query.device}. Use attn_implementation='sdpa' (or 'eager') on CPU or in fp32/fp64.")
    fn = load_flash_varlen()
    idx = plan.varlen_index()
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, H, D]
    pi = idx["prompt_token_index"]
    cu_p = idx["cu_seqlens_prompt"]
    parts = [_call(fn, q[pi], k[pi], v[pi], cu_p, cu_p, idx["max_seqlen_prompt"], idx["max_seqlen_prompt"], scaling)]
    if plan.N > 0:
        qi, kvi = idx["resp_q_index"], idx["resp_kv_index"]
        parts.append(_call(fn, q[qi], k[kvi], v[kvi], idx["cu_seqlens_q"], idx["cu_seqlens_k"],
                           idx["max_seqlen_q"], idx["max_seqlen_k"], scaling))
    return torch.cat(parts, 0)[idx["out_index"]].unsqueeze(0)  # [1, T, Hq, D]
