"""Split attention over a :class:`~zorro_verl.packing.ZorroPlan`, one backend per file behind one registry.

``attend(plan, backend, query [1, Hq, T, D], key [1, Hkv, T, D], value [1, Hkv, T, D], scaling) -> [1, T, Hq, D]``

Imports torch and the packing layer; flash-attn is imported lazily by :mod:`.primitives`.
"""

from __future__ import annotations

import torch

from zorro_verl.attention.base import Backend
from zorro_verl.attention.registry import BACKEND_NAMES, BACKENDS, available_backends, flash_available, get_backend
from zorro_verl.packing import ZorroPlan

__all__ = ["attend", "Backend", "BACKENDS", "BACKEND_NAMES", "get_backend", "available_backends", "flash_available"]


def attend(plan: ZorroPlan, backend: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           scaling: float) -> torch.Tensor:
    """Split attention of ``plan`` with the registered ``backend``. ``q [1, Hq, T, D]``, ``k/v [1, Hkv, T, D]``
    -> ``[1, T, Hq, D]``."""
    return get_backend(backend).attend(plan, query, key, value, scaling)
