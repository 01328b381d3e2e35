"""Hydra/verl engine config for the zorro FSDP engine (verl >= 0.9).

verl's config dataclasses reject unknown keys, so zorro's keys live in a subclass of ``FSDPEngineConfig`` that a
YAML node selects with ``_target_``::

    actor_rollout_ref.actor.fsdp_config:
      _target_: zorro_verl.integrations.verl.engine_config.ZorroFSDPEngineConfig
      zorro: {enable: true, rollout_n: ${actor_rollout_ref.rollout.n}, ...}

``zorro`` is validated by :class:`~zorro_verl.integrations.verl.config.ZorroSettings` when the dataclass is built
(in the driver and again in every worker, before the engine is created). With ``enable: true`` the engine is
registered here as well, so the run stops at start with the real error if the ``verl.plugins`` entry point did
not load (verl swallows plugin load errors).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from verl.workers.config import FSDPEngineConfig

from zorro_verl.integrations.verl.config import ZorroSettings

__all__ = ["ZorroFSDPEngineConfig", "zorro_settings_of"]


@dataclass
class ZorroFSDPEngineConfig(FSDPEngineConfig):
    """``FSDPEngineConfig`` plus ``zorro`` (a mapping of :data:`~zorro_verl.integrations.verl.config.SETTING_KEYS`)."""

    zorro: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        super().__post_init__()
        settings = ZorroSettings.from_mapping(self.zorro)  # raises ValueError naming the bad key
        object.__setattr__(self, "_zorro_settings", settings)
        if settings.enable:
            from zorro_verl.integrations.verl.plugin import ensure_registered

            ensure_registered()


def zorro_settings_of(engine_config) -> ZorroSettings:
    """Validated settings of an engine config; disabled defaults for a stock ``FSDPEngineConfig``."""
    s = getattr(engine_config, "_zorro_settings", None)
    if s is None:
        s = ZorroSettings.from_mapping(getattr(engine_config, "zorro", None) or {})
    return s
