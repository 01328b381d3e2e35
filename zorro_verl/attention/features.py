"""Per-layer attention features that change the math: sliding window, attention sinks, logit soft-capping
(docs/design/attention.md), and the dense attention math every pure-torch path shares.

One small :class:`AttentionFeatures` object travels from the registered attention function to ``attend`` and each
backend, so adding a feature changes no backend signature. Every feature is defined on the *original* per-row
positions (``plan.position_ids``), never on packed indices:

* **window** ``W``: key ``k`` is visible to query ``q`` iff ``pos[q] - pos[k] < W`` (on top of the split-attention
  rule) — transformers' ``sliding_window_overlay`` (``kv_idx > q_idx - sliding_window``) and flash-attn's
  ``window_size = (W - 1, ·)``;
* **sinks** ``s [Hq]`` (gpt-oss ``s_aux``): one extra logit per head in every query's softmax normaliser, with no
  value: ``o = sum_k exp(z_k - L) v_k``, ``L = log(sum_k exp(z_k) + exp(s_h))``;
* **softcap** ``c`` (Gemma 2): scores ``z = c * tanh(z / c)`` before masking and softmax;
* **chunk** ``C`` (Llama 4's ``chunked_attention`` layers, ``config.attention_chunk_size``): key ``k`` is visible to
  query ``q`` iff ``pos[q] // C == pos[k] // C`` (on top of the causal split-attention rule) — transformers'
  ``chunked_overlay`` on each row's own positions.

Split computations stay exact: the sink is merged once per query into the final log-sum-exp (:func:`add_sink`),
and a kernel backward run with the merged ``o`` / ``lse`` gives the exact ``dq``/``dk``/``dv`` (the sink has no
value, so it only enters through ``lse`` and ``rowsum(dO * o)``); the sink's own gradient is :func:`sink_grad`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["AttentionFeatures", "NO_FEATURES", "dense_attention", "add_sink", "sink_grad", "cap_scores",
           "window_visible", "position_visible"]


@dataclass(frozen=True, eq=False)
class AttentionFeatures:
    """What one attention layer adds to plain causal softmax attention (all optional).

    * ``window``: int ``W >= 1`` — key visible iff ``pos_q - pos_k < W`` (original per-row positions);
    * ``sinks``: ``[Hq]`` tensor (any float dtype, may require grad) — one sink logit per query head;
    * ``softcap``: float ``c > 0`` — scores become ``c * tanh(scores / c)``;
    * ``chunk``: int ``C >= 1`` — key visible iff ``pos_q // C == pos_k // C`` (original per-row positions).
    """

    window: Optional[int] = None
    sinks: Optional[torch.Tensor] = None
    softcap: Optional[float] = None
    chunk: Optional[int] = None

    def __post_init__(self):
        if self.window is not None and (isinstance(self.window, bool) or not isinstance(self.window, int)
                                        or self.window < 1):
            raise ValueError(f"sliding_window: expected an int >= 1 or None, got {self.window!r}.")
        if self.chunk is not None and (isinstance(self.chunk, bool) or not isinstance(self.chunk, int)
                                       or self.chunk < 1):
            raise ValueError(f"attention_chunk_size: expected an int >= 1 or None, got {self.chunk!r}.")
        if self.softcap is not None and not (isinstance(self.softcap, (int, float)) and self.softcap > 0):
            raise ValueError(f"softcap: expected a float > 0 or None, got {self.softcap!r}.")
        if self.sinks is not None and (not isinstance(self.sinks, torch.Tensor) or self.sinks.dim() != 1):
            raise ValueError(f"sinks: expected a 1-D [Hq] tensor or None, got "
                             f"{getattr(self.sinks, 'shape', type(self.sinks).__name__)}.")

    @property
    def plain(self) -> bool:
        """No feature at all: the ordinary split attention."""
        return self.window is None and self.sinks is None and self.softcap is None and self.chunk is None

    @property
    def position_rule(self) -> Optional[tuple]:
        """``(window, chunk)`` when the layer restricts keys by position (a mask rule on top of split attention),
        else None. Backends key their memoised masks by it."""
        return None if self.window is None and self.chunk is None else (self.window, self.chunk)

    def for_plan(self, plan) -> "AttentionFeatures":
        """The same features with a window or chunk that cannot cut anything in ``plan`` dropped: every position is
        below ``plan.max_row_len``, so ``pos_q - pos_k < W`` always holds when ``W >= max_row_len``, and every
        position lies in chunk 0 when ``C >= max_row_len`` (exact)."""
        out = self
        if out.window is not None and out.window >= plan.max_row_len:
            out = replace(out, window=None)
        if out.chunk is not None and out.chunk >= plan.max_row_len:
            out = replace(out, chunk=None)
        return out

    def check_heads(self, hq: int) -> None:
        if self.sinks is not None and self.sinks.numel() != hq:
            raise ValueError(f"sinks: expected one sink logit per query head ({hq}), got {self.sinks.numel()}.")


NO_FEATURES = AttentionFeatures()


def window_visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: Optional[int]) -> Optional[torch.Tensor]:
    """``q_pos [..., Lq, 1]``, ``k_pos [..., 1, Lk]`` int64 -> bool ``pos_q - pos_k < window`` (None: no window)."""
    return None if window is None else (q_pos - k_pos) < window


def position_visible(q_pos: torch.Tensor, k_pos: torch.Tensor, rule: Optional[tuple]) -> Optional[torch.Tensor]:
    """``q_pos [..., Lq, 1]``, ``k_pos [..., 1, Lk]`` int64 -> bool mask of a layer's position rule
    (:attr:`AttentionFeatures.position_rule` ``(window, chunk)``): ``pos_q - pos_k < window`` and
    ``pos_q // chunk == pos_k // chunk``, each where set (None: no rule)."""
    if rule is None:
        return None
    window, chunk = rule
    keep = window_visible(q_pos, k_pos, window)
    if chunk is not None:
        same = torch.div(q_pos, chunk, rounding_mode="floor") == torch.div(k_pos, chunk, rounding_mode="floor")
        keep = same if keep is None else keep & same
    return keep


def cap_scores(scores: torch.Tensor, softcap: Optional[float]) -> torch.Tensor:
    """``softcap * tanh(scores / softcap)`` in the scores' dtype (transformers' order of operations)."""
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def add_sink(o: torch.Tensor, lse: torch.Tensor, sinks: Optional[torch.Tensor]):
    """Put the sink into a finished attention: ``o [Tq, Hq, D]``, ``lse [Hq, Tq]`` (fp32/fp64) -> the same with
    ``lse' = logaddexp(lse, s_h)`` and ``o' = exp(lse - lse') o`` (weights in the lse dtype)."""
    if sinks is None:
        return o, lse
    s = sinks.detach().to(lse.dtype)[:, None]  # [Hq, 1]
    lse2 = torch.logaddexp(lse, s)
    w = torch.exp(lse - lse2).transpose(0, 1)[..., None]  # [Tq, Hq, 1]
    return (w * o.to(lse.dtype)).to(o.dtype), lse2


def sink_grad(dout: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Gradient of the sink logits: ``d s_h = -sum_q exp(s_h - lse_hq) rowsum(dO * o)_hq``. ``dout, o [Tq, Hq, D]``
    (the final output), ``lse [Hq, Tq]`` (with the sink) -> ``[Hq]`` in the sinks' dtype."""
    acc = lse.dtype
    delta = (dout.to(acc) * o.to(acc)).sum(-1).transpose(0, 1)  # [Hq, Tq]
    p_sink = torch.exp(sinks.detach().to(acc)[:, None] - lse)
    return -(p_sink * delta).sum(1).to(sinks.dtype)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, *,
                    mask: torch.Tensor | None = None, causal: bool = False, math: str = "sdpa",
                    features: AttentionFeatures = NO_FEATURES) -> torch.Tensor:
    """Batched attention. ``q [n, Hq, Lq, D]``, ``k/v [n, Hkv, Lk, D]``, ``mask`` bool broadcastable to
    ``[n, Hq, Lq, Lk]`` (True = attend; every query must see a key) or ``causal`` (top-left aligned, only for
    ``Lq == Lk``) -> ``[n, Hq, Lq, D]``. ``features.sinks`` / ``softcap`` are applied here (explicit math: SDPA has
    neither); a window or chunk must already be part of ``mask``.
    """
    hq, hkv = q.shape[1], k.shape[1]
    if math == "sdpa" and features.sinks is None and features.softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                              scale=scaling, enable_gqa=hq != hkv)
    if hq != hkv:  # repeat_kv semantics: kv head j serves q heads [j*n_rep, (j+1)*n_rep)
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
    scores = cap_scores(torch.matmul(q, k.transpose(-1, -2)) * scaling, features.softcap)  # [n, Hq, Lq, Lk]
    if causal and mask is None:
        lq, lk = q.shape[2], k.shape[2]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    # Half precisions take the softmax in fp32 (as every production kernel does); fp32/fp64 stay as they are.
    sm_dtype = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    scores = scores.to(sm_dtype)
    if features.sinks is not None:  # one extra logit per head, dropped after the softmax (it has no value)
        sink = features.sinks.to(sm_dtype).view(1, hq, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink], -1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs.to(q.dtype), v)
