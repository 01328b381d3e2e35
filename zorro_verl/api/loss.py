"""``packed_ppo_policy_loss``: the reference API's PPO loss on packed response tokens. Torch only."""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

__all__ = ["packed_ppo_policy_loss"]


def packed_ppo_policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    ref_log_prob: Optional[torch.Tensor] = None,
    clip_ratio: float = 0.2,
    kl_loss_coef: float = 0.001,
) -> Tuple[torch.Tensor, Dict[str, float]]:
    """PPO clipped policy loss on packed response tokens, token-mean, plus an optional low-variance KL (k3) term.

    Args:
        log_prob, old_log_prob, advantages, ref_log_prob: ``[N]`` float, one entry per trained token.
        clip_ratio: ``eps`` of ``clip(ratio, 1-eps, 1+eps)``; kl_loss_coef: weight of ``mean(k3(ref, log_prob))``.

    Returns:
        ``(loss [] , metrics)`` with ``actor/pg_loss``, ``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/kl_loss``
        (0 without ref) and ``actor/policy_loss`` (the returned loss) as floats.
    """
    for name, t in (("old_log_prob", old_log_prob), ("advantages", advantages), ("ref_log_prob", ref_log_prob)):
        if t is not None and (not isinstance(t, torch.Tensor) or t.shape != log_prob.shape):
            raise ValueError(f"{name}: expected shape {tuple(log_prob.shape)} (same as log_prob), got "
                             f"{tuple(getattr(t, 'shape', ())) if isinstance(t, torch.Tensor) else type(t).__name__}.")
    if log_prob.numel() == 0:
        raise ValueError("log_prob: expected at least one trained token, got none (all responses empty or masked).")
    old = old_log_prob.to(log_prob.dtype)
    adv = advantages.to(log_prob.dtype)
    neg_kl = log_prob - old
    ratio = torch.exp(neg_kl)
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1.0 - clip_ratio, 1.0 + clip_ratio)
    pg_loss = torch.maximum(pg1, pg2).mean()
    loss = pg_loss
    kl_val = torch.zeros((), dtype=log_prob.dtype, device=log_prob.device)
    if ref_log_prob is not None:
        d = ref_log_prob.to(log_prob.dtype) - log_prob
        kl_val = (torch.exp(d) - d - 1.0).mean()
        loss = loss + kl_loss_coef * kl_val
    stats = torch.stack([pg_loss.detach(), (pg2 > pg1).to(log_prob.dtype).mean(), (-neg_kl.detach()).mean(),
                         kl_val.detach(), loss.detach()]).tolist()
    keys = ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/kl_loss", "actor/policy_loss")
    return loss, dict(zip(keys, stats))
