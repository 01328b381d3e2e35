"""Hydra/verl engine configs for the zorro engines (verl >= 0.9; docs/design/verl.md). Data and validation only.

verl's config dataclasses reject unknown keys, so zorro's keys live in a subclass of verl's engine config that a
YAML node selects with ``_target_``: ``FSDPEngineConfig`` (``strategy: fsdp / fsdp2``) and ``McoreEngineConfig``
(``strategy: megatron``)::

    actor_rollout_ref.actor.fsdp_config:        # or actor_rollout_ref.actor.megatron (model_engine=megatron)
      _target_: zorro_verl.integrations.verl.v09.config.ZorroFSDPEngineConfig   # ... .ZorroMcoreEngineConfig
      zorro: {enable: true, rollout_n: ${actor_rollout_ref.rollout.n}, ...}

``zorro`` is validated by :class:`~zorro_verl.integrations.verl.settings.ZorroSettings` when the dataclass is
built (in the driver and again in every worker, before the engine is created). With ``enable: true`` it also checks
that the plugin is loaded in this process and that verl builds the zorro engine, so the run stops at start with the
reason instead of silently running the stock engine (verl swallows plugin load errors).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from verl.workers.config import FSDPEngineConfig, McoreEngineConfig

from zorro_verl.integrations.verl.settings import ZorroSettings
from zorro_verl.integrations.verl.v09.registration import check_engine_registered

__all__ = ["ZorroFSDPEngineConfig", "ZorroMcoreEngineConfig"]


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


@dataclass
class ZorroMcoreEngineConfig(McoreEngineConfig):
    """``McoreEngineConfig`` (verl's Megatron engine) plus ``zorro``: the same keys as
    :class:`ZorroFSDPEngineConfig`."""

    zorro: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        super().__post_init__()
        settings = ZorroSettings.from_mapping(self.zorro)
        object.__setattr__(self, "_zorro_settings", settings)
        if settings.enable:
            check_engine_registered("megatron")

