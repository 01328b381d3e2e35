"""The attention backend registry: every split-attention implementation zorro can run, by name.

Adding a backend is one new file following :mod:`.base` plus one line in :data:`BACKENDS`; the name then works
everywhere a backend is chosen (``DeduplicatedActor(attention_backend=...)``, the verl ``zorro.attention_backend``
key, the benchmark's ``--backends``).
"""

from __future__ import annotations

import torch

from zorro_verl.attention import copyfree, flex, reference, standard, varlen
from zorro_verl.attention.base import Backend
from zorro_verl.attention.primitives import flash_available

__all__ = ["BACKENDS", "BACKEND_NAMES", "get_backend", "available_backends", "flash_available"]

BACKENDS: dict[str, Backend] = {b.name: b for b in (
    reference.SDPA,
    reference.EAGER,
    standard.BACKEND,
    varlen.BACKEND,
    copyfree.BACKEND,
    flex.BACKEND,
)}
BACKEND_NAMES: tuple[str, ...] = tuple(BACKENDS)


def get_backend(name: str) -> Backend:
    """The registered backend ``name``; ``ValueError`` naming the choices otherwise."""
    try:
        return BACKENDS[name]
    except (KeyError, TypeError):
        raise ValueError(f"attention backend: expected one of {list(BACKEND_NAMES)}, got {name!r}.") from None


def available_backends(device) -> list[str]:
    """Names of the backends that run forward and backward on ``device`` here, in registry order."""
    dev = torch.device(device)
    return [name for name, b in BACKENDS.items() if b.available(dev)]
