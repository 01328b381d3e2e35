"""verl >= 0.9 plugin entry point (group ``verl.plugins``): registers the zorro FSDP engine in every process.

verl imports every ``verl.plugins`` entry point at ``import verl`` (driver and Ray workers) and only logs load errors
at DEBUG level. Loading this module calls :func:`register` once; that is the plugin contract (an entry point is
imported, never called). :func:`ensure_registered` is the loud self-check, called again by
``ZorroFSDPEngineConfig`` whenever a config enables zorro, so a plugin that failed to load surfaces its real error
at start instead of a silent stock run.

Registration swaps verl's stock ``FSDPEngineWithLMHead`` for :class:`ZorroFSDPEngineWithLMHead` in
``EngineRegistry`` for the ``fsdp``/``fsdp2`` backends (every device key it was registered for, plus ``cpu``). The
zorro class is the stock engine unless its engine config enables zorro, so runs without the preset are unchanged.
With ``ZORRO_VERL_CPU_PLATFORM=1`` the CPU test platform is installed first (it must precede the engine import).
"""

from __future__ import annotations

import logging
import os

__all__ = ["register", "ensure_registered", "register_group_balance"]

logger = logging.getLogger(__name__)

_BACKENDS = ("fsdp", "fsdp2")
_done = False


def register() -> None:
    """Install the engine into verl's ``EngineRegistry`` and the trainer's group-aware balancing (idempotent)."""
    global _done
    if _done:
        return
    from zorro_verl.integrations.verl.cpu_platform import CPU_PLATFORM_ENV, use_cpu_platform

    if os.environ.get(CPU_PLATFORM_ENV, "0") == "1":
        use_cpu_platform()
    from verl.workers.engine import EngineRegistry, FSDPEngineWithLMHead

    from zorro_verl.integrations.verl.engine import ZorroFSDPEngineWithLMHead

    table = EngineRegistry._engines.setdefault("language_model", {})
    for backend in _BACKENDS:
        slots = table.setdefault(backend, {})
        for key, cls in list(slots.items()):
            if cls is FSDPEngineWithLMHead:
                slots[key] = ZorroFSDPEngineWithLMHead
        slots.setdefault("cpu", ZorroFSDPEngineWithLMHead)
    # Every other language-model backend (fsdp_turbo reads the same fsdp_config) refuses a zorro-enabled config at
    # construction instead of silently running the stock forward.
    for backend, slots in table.items():
        if backend in _BACKENDS:
            continue
        for key, cls in list(slots.items()):
            if not getattr(cls, "_zorro_guard", False):
                slots[key] = _guarded(cls, backend)
    register_group_balance()
    _done = True


def _guarded(cls, backend: str):
    """A subclass of engine ``cls`` whose constructor raises when its engine config enables zorro."""

    def __init__(self, *args, **kwargs):
        from zorro_verl.integrations.verl.engine_config import zorro_settings_of

        engine_config = kwargs.get("engine_config", args[1] if len(args) > 1 else None)
        if engine_config is not None and zorro_settings_of(engine_config).enable:
            raise RuntimeError(f"zorro is enabled but the actor/ref strategy is {backend!r}: the zorro engine supports "
                               "strategy fsdp or fsdp2 (actor_rollout_ref.actor.strategy=fsdp2).")
        cls.__init__(self, *args, **kwargs)

    return type(cls.__name__, (cls,), {"__init__": __init__, "_zorro_guard": True,
                                       "__module__": cls.__module__, "__qualname__": cls.__qualname__})


def ensure_registered() -> None:
    """Register if needed, then check that verl resolves the zorro engine; raise a ``RuntimeError`` saying why not."""
    try:
        register()
    except Exception as e:  # the entry point's error would otherwise be swallowed by verl
        raise RuntimeError(f"zorro is enabled in the config but its verl plugin failed to load: {e!r}. Check that "
                           "zorro-verl and verl==0.9.x are installed in this Python environment (all Ray workers).") \
            from e
    from verl.workers.engine import EngineRegistry

    from zorro_verl.integrations.verl.engine import ZorroFSDPEngineWithLMHead

    for backend in _BACKENDS:
        try:
            cls = EngineRegistry.get_engine_cls("language_model", backend)
        except ValueError as e:
            raise RuntimeError(f"zorro is enabled but verl has no engine for backend {backend!r} on this device: "
                               f"{e}") from e
        if not issubclass(cls, ZorroFSDPEngineWithLMHead):
            raise RuntimeError(
                f"zorro is enabled in the config but verl builds {cls.__module__}.{cls.__qualname__} for strategy "
                f"{backend!r}, not the zorro engine (another plugin replaced it?). Remove the conflicting plugin or "
                "disable zorro (fsdp_config.zorro.enable=false).")


def register_group_balance() -> None:
    """Route the trainers' ``_balance_batch`` through zorro's group-aware balancing (switchable by config).

    The trainer modules are heavy and import rollout dependencies, so they are patched when (and in the process
    where) they are imported — a post-import hook — never imported here.
    """
    import wrapt

    from zorro_verl.integrations.verl import balance

    wrapt.register_post_import_hook(lambda mod: balance.install_v0_hook(mod), "verl.trainer.ppo.ray_trainer")
    wrapt.register_post_import_hook(lambda mod: balance.install_v1_hook(mod), "verl.trainer.ppo.v1.trainer_base")


def _verl_is_09_or_newer() -> bool:
    import importlib.metadata as md

    try:
        major, minor = (int(x) for x in md.version("verl").split(".")[:2])
    except Exception:  # unknown layout: let register() fail loudly if the engine API is missing
        return True
    return (major, minor) >= (0, 9)


# verl >= 0.9 imports this module at `import verl`; older verl (the legacy actor integration) has no engine plugin.
if os.environ.get("ZORRO_VERL_PLUGIN_DISABLE", "0") != "1" and _verl_is_09_or_newer():
    register()
