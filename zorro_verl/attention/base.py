"""The skeleton every attention backend follows (one file per backend, registered in :mod:`.registry`).

A backend computes split attention over a plan's packed row (docs/design/attention.md)::

    attend(plan, query [1, Hq, T, D], key [1, Hkv, T, D], value [1, Hkv, T, D], scaling, features) -> [1, T, Hq, D]

with ``features`` an :class:`~zorro_verl.attention.features.AttentionFeatures` (window, sinks, soft-cap) that
every backend honours exactly, and owns the index set it derives from the plan's core tensors (``index(plan)``,
memoised in ``plan.memo`` under the backend's key, built without a host sync: every size it needs is a Python int
of the plan). ``available(device)`` says whether it runs forward *and* backward on that device here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from zorro_verl.packing import ZorroPlan

__all__ = ["Backend", "always"]


@dataclass(frozen=True)
class Backend:
    """One registered split-attention implementation (see the module docstring for the contract)."""

    name: str
    attend: Callable[..., torch.Tensor]  # (plan, q, k, v, scaling, features) -> out
    index: Callable[[ZorroPlan], dict]
    available: Callable[[torch.device], bool]
    summary: str
    #: Device types it runs on at all (``available`` may still say no there, e.g. flex has no CPU backward).
    device_types: tuple = ("cpu", "cuda")


def always(device: torch.device) -> bool:
    """``available`` of the pure-torch backends: any device."""
    return True
