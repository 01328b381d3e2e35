"""Split attention over a :class:`~zorro_verl.packing.ZorroPlan`, one backend per file behind one registry.

``attend(plan, backend, query [1, Hq, T, D], key [1, Hkv, T, D], value [1, Hkv, T, D], scaling, features)
-> [1, T, Hq, D]`` (``value`` may have its own head dim: multi-latent attention), where ``features``
(:class:`AttentionFeatures`: sliding window, sinks, soft-cap) describes the layer.

Imports torch and the packing layer; flash-attn is imported lazily by :mod:`.primitives`.
"""

from __future__ import annotations

import torch

from zorro_verl.attention.base import Backend
from zorro_verl.attention.features import NO_FEATURES, AttentionFeatures
from zorro_verl.attention.registry import BACKEND_NAMES, BACKENDS, available_backends, flash_available, get_backend
from zorro_verl.packing import ZorroPlan

__all__ = ["attend", "AttentionFeatures", "NO_FEATURES", "Backend", "BACKENDS", "BACKEND_NAMES", "get_backend",
           "available_backends", "flash_available"]


def attend(plan: ZorroPlan, backend: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           scaling: float, features: AttentionFeatures | None = None) -> torch.Tensor:
    """Split attention of ``plan`` with the registered ``backend``. ``q [1, Hq, T, D]``, ``k/v [1, Hkv, T, D]``
    -> ``[1, T, Hq, D]``; ``v`` may have its own head dim ``Dv`` (multi-latent attention: ``k [1, Hkv, T, Dqk]``,
    ``v [1, Hkv, T, Dv]`` -> ``[1, T, Hq, Dv]``, by zero columns, exact). ``features`` (None: plain attention): the
    layer's window and chunk (in original positions), sinks ``[Hq]`` and soft-cap; a window or chunk no row is long
    enough to reach past is dropped first (exact)."""
    b = get_backend(backend)
    features = (features or NO_FEATURES).for_plan(plan)
    features.check_heads(query.shape[1])
    dqk, dv = query.shape[-1], value.shape[-1]
    if dqk == dv:
        return b.attend(plan, query, key, value, scaling, features)
    # multi-latent attention (DeepSeek-V3): q / k heads wider than v heads; the backends take one head dim. Zero
    # columns are exact: on q and k they add 0 to every score, on v they give output columns of 0, cut off here
    # (their gradients are dropped by the pad's backward)
    if dv < dqk:
        value = torch.nn.functional.pad(value, (0, dqk - dv))
    else:
        query, key = torch.nn.functional.pad(query, (0, dv - dqk)), torch.nn.functional.pad(key, (0, dv - dqk))
    return b.attend(plan, query, key, value, scaling, features)[..., :dv]
