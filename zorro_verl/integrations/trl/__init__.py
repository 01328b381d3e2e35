"""Hugging Face TRL integration: :class:`ZorroGRPOTrainer` and the one-line :func:`enable` (docs/trl.md)."""

from zorro_verl.integrations.trl.settings import TESTED_TRL, TRL_KEYS, trl_settings
from zorro_verl.integrations.trl.trainer import (
    SUPPORTED_LOSS_TYPES,
    ZorroGRPOTrainer,
    check_trl_version,
    disable,
    enable,
    is_enabled,
)

__all__ = ["ZorroGRPOTrainer", "enable", "disable", "is_enabled", "check_trl_version", "SUPPORTED_LOSS_TYPES",
           "TESTED_TRL", "TRL_KEYS", "trl_settings"]
