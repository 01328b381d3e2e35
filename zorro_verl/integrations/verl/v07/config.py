"""Hydra config node for the verl 0.7 legacy actor: ``fsdp_config.zorro`` (same key names as the 0.9 plugin;
docs/design/verl.md).

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

import functools
from dataclasses import dataclass, field
from typing import Any

from verl.workers.config import FSDPEngineConfig

from zorro_verl.integrations.verl.settings import ZorroSettings, settings_of

__all__ = ["ZorroLegacyFSDPEngineConfig", "legacy_settings_of", "refuse_engine_workers"]


@dataclass
class ZorroLegacyFSDPEngineConfig(FSDPEngineConfig):
    """verl 0.7 ``FSDPEngineConfig`` plus ``zorro`` (a mapping of the keys of :class:`ZorroSettings`)."""

    zorro: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        super().__post_init__()
        # BaseConfig freezes set attributes; the validated settings are stored once, beside the raw mapping.
        object.__setattr__(self, "_zorro_settings", ZorroSettings.from_mapping(self.zorro))
        if self._zorro_settings.enable:
            refuse_engine_workers()


_GUARD_FLAG = "_zorro_refuses_engine_workers"


def refuse_engine_workers() -> None:
    """Make verl 0.7's new engine workers refuse a zorro-enabled engine config (idempotent).

    zorro's verl 0.7 integration is the legacy actor (``DataParallelPPOActor``, built by the legacy FSDP workers).
    With ``trainer.use_legacy_worker_impl=disable`` verl 0.7 builds ``verl.workers.engine_workers`` instead, which
    never constructs that actor and would train the stock way with zorro enabled. Those workers, and only they,
    build every actor / ref / critic engine from a ``TrainingWorkerConfig(engine_config=...)``, in the worker
    process, right after the engine config (this class) is built: its constructor raises there. Called by the
    ``__post_init__`` of a zorro-enabled config, so it is in place whichever way the plugin was loaded.
    """
    from verl.workers.config import TrainingWorkerConfig

    init = TrainingWorkerConfig.__init__
    if getattr(init, _GUARD_FLAG, False):
        return

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if settings_of(self.engine_config).enable:
            raise RuntimeError(
                "zorro is enabled (fsdp_config.zorro.enable=true) but verl 0.7 is building its new engine workers "
                "(trainer.use_legacy_worker_impl=disable), which run the stock forward: zorro's verl 0.7 "
                "integration replaces the legacy workers' DataParallelPPOActor. Set "
                "trainer.use_legacy_worker_impl=auto (or enable), disable zorro "
                "(actor_rollout_ref.actor.fsdp_config.zorro.enable=false and the same for ref), or use verl >= 0.9 "
                "with the engine plugin (configs/zorro_ppo_trainer.yaml).")

    setattr(__init__, _GUARD_FLAG, True)
    TrainingWorkerConfig.__init__ = __init__


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
