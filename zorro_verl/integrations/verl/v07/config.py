"""Hydra config node for the verl 0.7 legacy actor: ``fsdp_config.zorro`` (same key names as the 0.9 plugin;
docs/DESIGN.md §8).

verl 0.7's ``FSDPEngineConfig`` dataclass rejects unknown keys, so zorro's keys live in a subclass that the
``fsdp_config`` node of the actor (and of the reference policy) selects with ``_target_``::

    actor_rollout_ref.actor.fsdp_config:
      _target_: zorro_verl.integrations.verl.v07.config.ZorroLegacyFSDPEngineConfig
      zorro: {enable: true, rollout_n: ${actor_rollout_ref.rollout.n}, logits_optimization: none,
              attention_backend: auto, on_unsupported: raise}

The mapping is validated by :class:`~zorro_verl.integrations.verl.settings.ZorroSettings` (shared with the 0.9
plugin) when the dataclass is built, so a typo stops the run in the driver. Imports verl 0.7.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from verl.workers.config import FSDPEngineConfig

from zorro_verl.integrations.verl.settings import ZorroSettings, settings_of

__all__ = ["ZorroLegacyFSDPEngineConfig", "legacy_settings_of"]


@dataclass
class ZorroLegacyFSDPEngineConfig(FSDPEngineConfig):
    """verl 0.7 ``FSDPEngineConfig`` plus ``zorro`` (a mapping of the keys of :class:`ZorroSettings`)."""

    zorro: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        super().__post_init__()
        # BaseConfig freezes set attributes; the validated settings are stored once, beside the raw mapping.
        object.__setattr__(self, "_zorro_settings", ZorroSettings.from_mapping(self.zorro))


def legacy_settings_of(actor_config) -> ZorroSettings:
    """Validated zorro settings of a verl 0.7 actor / ref config (``ActorConfig`` dataclass or OmegaConf node).

    Reads ``actor_config.fsdp_config.zorro``; a config without it (a stock ``FSDPEngineConfig``) gives the disabled
    defaults. Unknown keys or bad values raise ``ValueError`` naming the key.
    """
    fsdp_config = _get(actor_config, "fsdp_config")
    return ZorroSettings() if fsdp_config is None else settings_of(fsdp_config)


def _get(cfg, key: str):
    if cfg is None:
        return None
    if hasattr(cfg, "get"):  # OmegaConf DictConfig, dict and verl's BaseConfig all have .get
        try:
            return cfg.get(key, None)
        except Exception:  # noqa: BLE001 - a struct DictConfig without the key
            pass
    return getattr(cfg, key, None)
