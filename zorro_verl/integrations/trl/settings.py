"""The TRL integration's settings (docs/trl.md). Imports no TRL.

The keys of verl's ``zorro`` node that mean something in TRL (:class:`~zorro_verl.integrations.verl.settings.
ZorroSettings`, validated by it): ``attention_backend`` (``auto`` default), ``logits_optimization``
(``none|compute|memory``), ``sharing`` (``prompt|prefix``), ``min_shared_len``, ``on_unsupported`` (``raise|warn``).
Unknown keys and bad values raise ``ValueError`` naming the key.
"""

from __future__ import annotations

from typing import Any, Optional

from zorro_verl.integrations.verl.settings import ZorroSettings

__all__ = ["TRL_KEYS", "TESTED_TRL", "FIX_HINT", "MICRO_BATCH_ORDERS", "TrlSettings", "trl_settings"]

#: The keys a TRL user may set (``enable`` is the switch itself; rollout_n / group balancing are verl trainer keys).
TRL_KEYS = ("attention_backend", "logits_optimization", "sharing", "min_shared_len", "on_unsupported",
            "micro_batch_order")
MICRO_BATCH_ORDERS = ("stock", "groups")
#: The TRL minor version whose private seam (``GRPOTrainer._get_per_token_logps_and_entropies``) is tested.
TESTED_TRL = "1.16."
#: Quoted in every refusal.
FIX_HINT = ("train with stock TRL (drop ZorroGRPOTrainer / zorro_verl.integrations.trl.enable()), or pass "
            "on_unsupported='warn' to run TRL's stock forward for such calls")


class TrlSettings(ZorroSettings):
    """:class:`ZorroSettings` (``enable=True``) plus TRL's ``micro_batch_order``."""

    __slots__ = ("micro_batch_order",)

    def __init__(self, micro_batch_order: str = "stock", **keys):
        # TRL's fused head never materialises the logits: the chunked head keeps zorro's memory at or below it
        keys.setdefault("logits_optimization", "memory")
        super().__init__(**keys)
        if micro_batch_order not in MICRO_BATCH_ORDERS:
            raise ValueError(f"zorro.micro_batch_order: expected one of {list(MICRO_BATCH_ORDERS)}, got "
                             f"{micro_batch_order!r}.")
        self.micro_batch_order = micro_batch_order

    def to_dict(self) -> dict:
        return {**super().to_dict(), "micro_batch_order": self.micro_batch_order}


def trl_settings(settings: Optional[Any] = None, **keys) -> TrlSettings:
    """Validated settings from a mapping / :class:`ZorroSettings` and/or keywords (keywords win).

    Returns a :class:`TrlSettings` with ``enable=True``. Raises ``ValueError`` for keys outside :data:`TRL_KEYS`.
    """
    items: dict = {}
    if isinstance(settings, ZorroSettings):
        items = {k: getattr(settings, k) for k in TRL_KEYS if hasattr(settings, k)}
    elif settings is not None:
        if not hasattr(settings, "items"):
            raise TypeError(f"zorro settings: expected a dict of {list(TRL_KEYS)} or a ZorroSettings, got "
                            f"{type(settings).__name__}.")
        items = dict(settings.items())
    items.update(keys)
    unknown = sorted(k for k in items if k not in TRL_KEYS)
    if unknown:
        raise ValueError(f"zorro settings for TRL: unknown key(s) {unknown}; valid keys are {list(TRL_KEYS)}.")
    return TrlSettings(enable=True, **items)
