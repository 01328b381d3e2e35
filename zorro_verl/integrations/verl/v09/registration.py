"""Registration of the zorro engine in verl >= 0.9 (docs/design/verl.md). No side effects at import: the plugin
(:mod:`.plugin`) calls :func:`install`, and the config class calls :func:`check_engine_registered`.

:func:`install` registers post-import hooks, so nothing heavy is imported at ``import verl``:

* when ``verl.workers.engine`` is imported, verl's stock ``FSDPEngineWithLMHead`` is swapped for
  :class:`~zorro_verl.integrations.verl.v09.engine.ZorroFSDPEngineWithLMHead` in ``EngineRegistry`` for the
  ``fsdp``/``fsdp2`` backends (every device key it was registered for, plus ``cpu``), and, where verl's Megatron
  engine imported (megatron-core installed), ``MegatronEngineWithLMHead`` for
  :class:`~zorro_verl.integrations.verl.v09.megatron_engine.ZorroMegatronEngineWithLMHead` (``megatron``); a
  zorro class is the stock engine unless its engine config enables zorro, so runs without the preset are unchanged.
  Every other language-model backend (``fsdp_turbo`` reads the same ``fsdp_config``) is wrapped so that it refuses a
  zorro-enabled config instead of silently running the stock forward; verl's ``FSDPEngineWithValueHead`` (the
  critic, ``value_model``) is swapped for
  :class:`~zorro_verl.integrations.verl.v09.value_engine.ZorroFSDPEngineWithValueHead` the same way, and, where
  verl's Megatron engine imported, ``MegatronEngineWithValueHead`` for
  :class:`~zorro_verl.integrations.verl.v09.megatron_value_engine.ZorroMegatronEngineWithValueHead`; every other
  value-model backend refuses a zorro-enabled config;
* when the trainers are imported, their ``_balance_batch`` goes through zorro's group-aware balancing
  (:mod:`.balance`, switchable by config), and the V1 trainer reports the zorro metrics of its log-prob passes
  (:mod:`.trainer_metrics`). verl's experimental ``OneStepOffRayTrainer`` and ``FullyAsyncTrainer`` subclass
  ``RayPPOTrainer`` without overriding ``_balance_batch`` and inherit the wrapped one; one-step-off is marked as
  balancing one step ahead (:func:`~.balance.install_one_step_off_hook`).

Besides the ``verl.plugins`` entry point (skipped when ``VERL_USE_EXTERNAL_PLUGINS`` excludes it), the preset loads
the plugin through ``actor_rollout_ref.model.external_lib``, which verl imports unconditionally wherever it builds
the model config — in the trainer process (the V1 trainer's tokenizer setup) and in every worker.
"""

from __future__ import annotations

import importlib.metadata as md
import logging
import os
from typing import Optional

from zorro_verl.integrations.verl.settings import settings_of
from zorro_verl.integrations.verl.v09 import balance, roles, trainer_metrics

__all__ = ["install", "is_installed", "check_engine_registered", "why_not_installed", "entry_point_skipped",
           "PLUGIN_DISABLE_ENV", "PLUGIN_MODULE"]

logger = logging.getLogger(__name__)

#: Set to ``1`` to keep the ``verl.plugins`` entry point from installing anything (zorro-enabled configs then stop
#: at start with the reason).
PLUGIN_DISABLE_ENV = "ZORRO_VERL_PLUGIN_DISABLE"
#: The plugin module (the entry point's target; the preset also names it in ``actor_rollout_ref.model.external_lib``).
PLUGIN_MODULE = "zorro_verl.integrations.verl.v09.plugin"
_BACKENDS = ("fsdp", "fsdp2")
#: The backends of each zorro engine config's ``strategy`` family, checked by :func:`check_engine_registered`.
_STRATEGY_BACKENDS = {"fsdp": _BACKENDS, "megatron": ("megatron",)}
_installed = False


def verl_is_09_or_newer() -> bool:
    try:
        major, minor = (int(x) for x in md.version("verl").split(".")[:2])
    except Exception:  # unknown layout: let the engine import fail loudly if the API is missing
        return True
    return (major, minor) >= (0, 9)


def install() -> None:
    """Register the post-import hooks (idempotent). A no-op under verl < 0.9 or with ``ZORRO_VERL_PLUGIN_DISABLE=1``."""
    global _installed
    if _installed or os.environ.get(PLUGIN_DISABLE_ENV, "0") == "1" or not verl_is_09_or_newer():
        return
    import wrapt  # a dependency of the verl extra only

    wrapt.register_post_import_hook(_register_engine, "verl.workers.engine")
    wrapt.register_post_import_hook(balance.install_v0_hook, "verl.trainer.ppo.ray_trainer")
    wrapt.register_post_import_hook(balance.install_v1_hook, "verl.trainer.ppo.v1.trainer_base")
    # the experimental trainers subclass RayPPOTrainer and inherit its wrapped _balance_batch; one-step-off balances
    # the next step's batch while a step trains
    wrapt.register_post_import_hook(balance.install_one_step_off_hook,
                                    "verl.experimental.one_step_off_policy.ray_trainer")
    wrapt.register_post_import_hook(trainer_metrics.install_v1_hook, "verl.trainer.ppo.v1.trainer_base")
    wrapt.register_post_import_hook(roles.install_v0_hook, "verl.trainer.ppo.ray_trainer")
    wrapt.register_post_import_hook(roles.install_v1_hook, "verl.trainer.ppo.v1.trainer_base")
    _installed = True


def is_installed() -> bool:
    return _installed


#: The zorro engine modules whose classes the hook registers, with their class names.
_ENGINE_MODULES = {"zorro_verl.integrations.verl.v09.engine": "ZorroFSDPEngineWithLMHead",
                   "zorro_verl.integrations.verl.v09.value_engine": "ZorroFSDPEngineWithValueHead",
                   "zorro_verl.integrations.verl.v09.megatron_engine": "ZorroMegatronEngineWithLMHead",
                   "zorro_verl.integrations.verl.v09.megatron_value_engine": "ZorroMegatronEngineWithValueHead"}
_pending: list = []


def _mid_import() -> bool:
    """Whether one of :data:`_ENGINE_MODULES` is being imported (in ``sys.modules`` without its class yet): it was
    imported before ``verl.workers.engine``, whose import (by that module) ran this hook."""
    import sys

    return any(name in sys.modules and not hasattr(sys.modules[name], cls) for name, cls in _ENGINE_MODULES.items())


def register_pending() -> None:
    """Run the hook that was deferred while a zorro engine module was being imported (:func:`_register_engine`),
    once both engine modules are complete. Called by :func:`check_engine_registered`, which every zorro-enabled
    engine config runs before verl looks an engine up."""
    if _pending and not _mid_import():
        _register_engine(_pending.pop())


def _register_engine(engine_package) -> None:
    """Post-import hook of ``verl.workers.engine``: put the zorro engines in its ``EngineRegistry``. When a zorro
    engine module is itself being imported (a process that imports it before verl's engines: its import of verl's
    engines ran this hook) the registration waits until a zorro config checks it (:func:`register_pending`)."""
    # Imported here, not at module level: the engine module imports verl's FSDP engine, which must not be loaded at
    # `import verl` (it resolves verl's device platform; tests install a CPU platform before that).
    if _mid_import():
        _pending.append(engine_package)
        return
    from zorro_verl.integrations.verl.v09.engine import ZorroFSDPEngineWithLMHead

    table = engine_package.EngineRegistry._engines.setdefault("language_model", {})
    swaps = {backend: (engine_package.FSDPEngineWithLMHead, ZorroFSDPEngineWithLMHead) for backend in _BACKENDS}
    if getattr(engine_package, "MegatronEngineWithLMHead", None) is not None:  # verl imported its Megatron engine
        from zorro_verl.integrations.verl.v09.megatron_engine import ZorroMegatronEngineWithLMHead

        swaps["megatron"] = (engine_package.MegatronEngineWithLMHead, ZorroMegatronEngineWithLMHead)
    for backend, (stock, zorro) in swaps.items():
        slots = table.setdefault(backend, {})
        for key, cls in list(slots.items()):
            if cls is stock:
                slots[key] = zorro
        slots.setdefault("cpu", zorro)
    for backend, slots in table.items():
        if backend in swaps:
            continue
        for key, cls in list(slots.items()):
            if not getattr(cls, "_zorro_guard", False):
                slots[key] = _guarded(cls, backend)
    # the critic: verl's FSDP and Megatron value-head engines -> zorro's (every device key, plus cpu); any other
    # value-model backend refuses a zorro-enabled config
    from zorro_verl.integrations.verl.v09.value_engine import ZorroFSDPEngineWithValueHead

    values = engine_package.EngineRegistry._engines.setdefault("value_model", {})
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithValueHead as stock_value  # not re-exported
    value_swaps = {backend: (stock_value, ZorroFSDPEngineWithValueHead) for backend in _BACKENDS}
    if getattr(engine_package, "MegatronEngineWithValueHead", None) is not None:
        from zorro_verl.integrations.verl.v09.megatron_value_engine import ZorroMegatronEngineWithValueHead

        value_swaps["megatron"] = (engine_package.MegatronEngineWithValueHead, ZorroMegatronEngineWithValueHead)
    for backend, (stock, zorro) in value_swaps.items():
        slots = values.setdefault(backend, {})
        for key, cls in list(slots.items()):
            if cls is stock:
                slots[key] = zorro
        slots.setdefault("cpu", zorro)
    for backend, slots in values.items():
        if backend in value_swaps:
            continue
        for key, cls in list(slots.items()):
            if not getattr(cls, "_zorro_guard", False):
                slots[key] = _value_model_guarded(cls, backend)


def _guarded(cls, backend: str):
    """A subclass of engine ``cls`` whose constructor raises when its engine config enables zorro."""

    def __init__(self, *args, **kwargs):
        engine_config = kwargs.get("engine_config", args[1] if len(args) > 1 else None)
        if engine_config is not None and settings_of(engine_config).enable:
            raise RuntimeError(f"zorro is enabled but the actor/ref strategy is {backend!r}: the zorro engines support "
                               "strategy fsdp / fsdp2 (actor_rollout_ref.actor.strategy=fsdp2) and megatron (with "
                               "megatron-core installed).")
        cls.__init__(self, *args, **kwargs)

    return type(cls.__name__, (cls,), {"__init__": __init__, "_zorro_guard": True,
                                       "__module__": cls.__module__, "__qualname__": cls.__qualname__})


def _value_model_guarded(cls, backend: str):
    """A subclass of value-model (critic) engine ``cls`` of a backend without a zorro value engine (e.g.
    ``torchtitan``, or ``megatron`` where megatron-core does not import) whose constructor raises when its engine
    config enables zorro: the critic would silently run verl's stock forward with a config that asks for zorro.
    Configs that do not enable zorro build the stock engine unchanged."""

    def __init__(self, *args, **kwargs):
        engine_config = kwargs.get("engine_config", args[1] if len(args) > 1 else None)
        if engine_config is not None and settings_of(engine_config).enable:
            raise ValueError(
                f"critic.{backend}.zorro: expected no zorro node (or enable=false) in the critic's engine config for "
                f"strategy {backend!r}, got enable=true. zorro's value-model (critic) engine runs on strategy fsdp / "
                f"fsdp2 and megatron only; this backend's value-model engine ({cls.__qualname__}) would run verl's "
                f"stock forward. Use critic.strategy=fsdp2 with critic.fsdp.zorro (or megatron with "
                f"critic.megatron.zorro), or remove critic.{backend}.zorro (and its _target_) or set "
                f"critic.{backend}.zorro.enable=false.")
        cls.__init__(self, *args, **kwargs)

    return type(cls.__name__, (cls,), {"__init__": __init__, "_zorro_guard": True, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})


def _engine_device() -> str:
    """The device key verl's ``EngineRegistry`` looks engines up by (``VERL_ENGINE_DEVICE`` overrides it)."""
    if os.environ.get("VERL_ENGINE_DEVICE"):
        return os.environ["VERL_ENGINE_DEVICE"]
    from verl.utils.device import get_device_name

    return get_device_name()


def entry_point_skipped() -> Optional[str]:
    """Why ``import verl`` in a process with this environment would not install zorro's hooks through the
    ``verl.plugins`` entry point, or None when it would (barring an import error, see :func:`why_not_installed`)."""
    if os.environ.get(PLUGIN_DISABLE_ENV, "0") == "1":
        return f"{PLUGIN_DISABLE_ENV}=1 is set in this process"
    if not verl_is_09_or_newer():
        return f"verl {md.version('verl')} is older than 0.9 (use the verl 0.7 integration, configs/zorro_legacy.yaml)"
    if not any(ep.name == "zorro_verl" for ep in md.entry_points(group="verl.plugins")):
        return ("the `verl.plugins` entry point of zorro-verl is not installed in this Python environment (pip install "
                "zorro-verl into the environment of every Ray worker)")
    policy = os.environ.get("VERL_USE_EXTERNAL_PLUGINS", "auto").strip().lower()
    if policy == "none" or (policy not in ("auto", "") and "zorro_verl" not in policy.split(",")):
        return f"VERL_USE_EXTERNAL_PLUGINS={policy!r} does not load the entry point 'zorro_verl'"
    return None


def why_not_installed() -> str:
    return entry_point_skipped() or ("verl failed to load the plugin (it logs plugin errors at DEBUG only); `python -c "
                                     "\"import zorro_verl.integrations.verl.v09.plugin\"` shows the error")


def check_engine_registered(strategy: str = "fsdp") -> None:
    """Raise ``RuntimeError`` saying why, unless the plugin is installed in this process and verl resolves the zorro
    engine for ``strategy``'s backends (``fsdp``: ``fsdp`` and ``fsdp2``; ``megatron``).

    When only ``VERL_USE_EXTERNAL_PLUGINS`` kept verl from loading the entry point, the config that enables zorro is
    the explicit opt-in: the hooks are installed here (logged once) instead of refusing."""
    if not _installed and why_not_installed().startswith("VERL_USE_EXTERNAL_PLUGINS="):
        logger.warning("zorro: %s; installing zorro's hooks from the zorro engine config instead.",
                       why_not_installed())
        install()
    if not _installed:
        raise RuntimeError(f"zorro is enabled in the config but its verl plugin is not loaded: {why_not_installed()}.")
    from verl.workers.engine import EngineRegistry  # the import runs the post-import hook if it has not run yet

    register_pending()

    for backend in _STRATEGY_BACKENDS[strategy]:
        try:
            cls = EngineRegistry.get_engine_cls("language_model", backend)
        except (ValueError, AssertionError) as e:
            # verl asserts on an unknown model type / backend and raises ValueError for an unknown device
            if strategy == "megatron":
                raise RuntimeError(
                    f"zorro is enabled in a Megatron engine config but verl's EngineRegistry has no language_model "
                    f"engine for strategy 'megatron' on device {_engine_device()!r} ({type(e).__name__}: {e}). verl "
                    "registers its Megatron engine only when megatron-core (and mbridge) import: install them "
                    "(pip install megatron-core mbridge; python -c 'import verl.workers.engine.megatron' shows the "
                    "error), or disable zorro (megatron.zorro.enable=false).") from e
            raise RuntimeError(
                f"zorro is enabled but verl's EngineRegistry has no language_model engine for strategy {backend!r} "
                f"on device {_engine_device()!r} ({type(e).__name__}: {e}). The zorro engine needs strategy fsdp or "
                "fsdp2 on a device verl registers FSDP engines for (cuda, npu; cpu is added by zorro): check "
                "actor_rollout_ref.actor.strategy, the VERL_ENGINE_DEVICE environment variable and that "
                "verl.workers.engine imported cleanly, or disable zorro (fsdp_config.zorro.enable=false).") from e
        # the critic's engine (value_model) too: the same config class enables it
        value_cls = EngineRegistry._engines.get("value_model", {}).get(backend, {}).get(_engine_device())
        if value_cls is not None and not getattr(value_cls, "zorro_engine", False):
            raise RuntimeError(
                f"zorro is enabled in the config but verl builds {value_cls.__module__}.{value_cls.__qualname__} "
                f"as the value-model (critic) engine for strategy {backend!r}, not zorro's (another plugin "
                f"replaced it?). Remove the conflicting plugin or disable zorro (critic.{strategy}.zorro.enable="
                "false).")
        if not getattr(cls, "zorro_engine", False):  # the zorro engines and their subclasses
            raise RuntimeError(
                f"zorro is enabled in the config but verl builds {cls.__module__}.{cls.__qualname__} for strategy "
                f"{backend!r}, not the zorro engine (another plugin replaced it?). Remove the conflicting plugin or "
                "disable zorro (fsdp_config.zorro.enable=false).")
