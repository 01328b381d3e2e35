"""Hydra/verl engine config for the zorro FSDP engine (verl >= 0.9; docs/DESIGN.md §8). Data and validation only.

verl's config dataclasses reject unknown keys, so zorro's keys live in a subclass of ``FSDPEngineConfig`` that a
YAML node selects with ``_target_``::

    actor_rollout_ref.actor.fsdp_config:
      _target_: zorro_verl.integrations.verl.v09.config.ZorroFSDPEngineConfig
      zorro: {enable: true, rollout_n: ${actor_rollout_ref.rollout.n}, ...}

``zorro`` is validated by :class:`~zorro_verl.integrations.verl.settings.ZorroSettings` when the dataclass is
built (in the driver and again in every worker, before the engine is created). With ``enable: true`` it also checks
that the plugin is loaded in this process and that verl builds the zorro engine, so the run stops at start with the
reason instead of silently running the stock engine (verl swallows plugin load errors).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from verl.workers.config import FSDPEngineConfig

from zorro_verl.integrations.verl.settings import ZorroSettings
from zorro_verl.integrations.verl.v09.registration import check_engine_registered

__all__ = ["ZorroFSDPEngineConfig"]


@dataclass
class ZorroFSDPEngineConfig(FSDPEngineConfig):
    """``FSDPEngineConfig`` plus ``zorro``: a mapping of the keys of
    :class:`~zorro_verl.integrations.verl.settings.ZorroSettings`."""

    zorro: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        super().__post_init__()
        settings = ZorroSettings.from_mapping(self.zorro)  # raises ValueError naming the bad key
        object.__setattr__(self, "_zorro_settings", settings)
        if settings.enable:
            check_engine_registered()

