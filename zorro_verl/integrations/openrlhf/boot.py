"""The OpenRLHF loader: post-import hooks installed in every Python process of the environment (docs/DESIGN.md §12).

OpenRLHF has no plugin entry points and builds its models inside Ray actors (policy, reference, critic...), each a
separate Python process started by Ray's raylet. The one code path that runs in *every* such process, however the
job is launched (``ray job submit``, a plain ``python -m openrlhf.cli.train_ppo_ray`` that starts a local cluster,
or a driver joining a ``ray start`` cluster), is the interpreter's start-up: ``site`` executes the ``import`` lines
of every ``.pth`` file in site-packages. :func:`install_pth` writes ``zorro_verl_openrlhf.pth`` there (once, by
``zorro-verl openrlhf install``); its one line imports this module and calls :func:`install` **only** when
``ZORRO_OPENRLHF`` is on in that process's environment, so with the switch off nothing of zorro is imported.
(Ray's ``runtime_env`` ``worker_process_setup_hook`` would need the hook named in OpenRLHF's own ``ray.init`` or in
``ray job submit``'s runtime env, and it does not run in the driver, where the experience maker lives.)

:func:`install` registers ``wrapt`` post-import hooks; each patches one OpenRLHF module when, and where, it is
imported:

* ``openrlhf.models.actor`` — ``Actor.forward`` -> :func:`~.actor.zorro_forward` (actor training, old log-probs,
  reference, EMA);
* ``openrlhf.trainer.ppo_utils.replay_buffer`` — dynamic batching's per-step partitions regrouped on the actor's
  buffer (:func:`~.batching.install_replay_buffer`);
* ``openrlhf.trainer.ppo_utils.experience_maker`` — ``RemoteExperienceMaker``: the start-up checks (OpenRLHF's
  arguments; that the job's Ray workers got the switch too, :func:`check_workers`) and
  :func:`~.batching.split_rollout_samples`;
* ``openrlhf.trainer.ppo_trainer`` — :func:`~.batching.balance_experiences` (dynamic batching's DP balancing) and
  the trainer's metrics (:func:`~.actor.with_trainer_metrics`);
* ``openrlhf.trainer.ray.ppo_actor`` — training micro-batches regrouped inside each optimizer step
  (:func:`~.batching.install_training_batches`); ``zorro/*`` metrics in the status OpenRLHF logs after each step;
* ``openrlhf.trainer.ray.launcher`` — ``BaseModelActor.zorro_counts`` (the reference model's counters).

``group_balance=false`` in ``ZORRO_OPENRLHF_OPTIONS`` leaves OpenRLHF's batching alone (only the forward changes).
"""

from __future__ import annotations

import logging
import sysconfig
from pathlib import Path
from typing import Optional

from zorro_verl.integrations.openrlhf.settings import ENV_SWITCH, settings_from_env

__all__ = ["install", "PTH_NAME", "PTH_LINE", "install_pth", "uninstall_pth", "pth_path", "main", "check_workers",
           "workers_have_switch", "on_actor_module",
           "on_replay_buffer_module", "on_model_actors_module", "on_experience_maker_module", "on_ppo_trainer_module",
           "on_ppo_actor_module"]

logger = logging.getLogger(__name__)

PTH_NAME = "zorro_verl_openrlhf.pth"
#: ``site`` executes a .pth line that starts with ``import``; everything else is cheap string work, so a process
#: without the switch pays nothing.
PTH_LINE = (f"import os; os.environ.get({ENV_SWITCH!r}, '').strip().lower() in ('1', 'true', 'yes', 'on') and "
            "__import__('zorro_verl.integrations.openrlhf.boot', fromlist=['install']).install()\n")

_installed = False


def install() -> None:
    """Validate the settings and register the post-import hooks (idempotent). Called by the .pth line."""
    global _installed
    if _installed:
        return
    settings = settings_from_env()  # bad options fail here, in every process
    import wrapt  # the `openrlhf` extra

    wrapt.register_post_import_hook(on_actor_module, "openrlhf.models.actor")
    wrapt.register_post_import_hook(on_experience_maker_module, "openrlhf.trainer.ppo_utils.experience_maker")
    wrapt.register_post_import_hook(on_ppo_actor_module, "openrlhf.trainer.ray.ppo_actor")
    wrapt.register_post_import_hook(on_ppo_trainer_module, "openrlhf.trainer.ppo_trainer")
    wrapt.register_post_import_hook(on_model_actors_module, "openrlhf.trainer.ray.launcher")
    if settings.group_balance:
        wrapt.register_post_import_hook(on_replay_buffer_module, "openrlhf.trainer.ppo_utils.replay_buffer")
    _installed = True


def on_actor_module(module) -> None:
    from zorro_verl.integrations.openrlhf.actor import install as install_forward

    install_forward(module.Actor)
    logger.info("zorro: OpenRLHF Actor.forward replaced by the deduplicated forward")


def on_replay_buffer_module(module) -> None:
    from zorro_verl.integrations.openrlhf.batching import install_replay_buffer

    install_replay_buffer(module.NaiveReplayBuffer)


def on_experience_maker_module(module) -> None:
    from zorro_verl.integrations.openrlhf.actor import check_args
    from zorro_verl.integrations.openrlhf.batching import split_rollout_samples

    cls = module.RemoteExperienceMaker
    if getattr(cls, "_zorro_installed", False):
        return
    init = cls.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        check_args(self.strategy.args, settings_from_env())  # at trainer construction, before any rollout
        check_workers()

    cls.__init__ = __init__
    if settings_from_env().group_balance:
        cls.split_rollout_samples = split_rollout_samples
    cls._zorro_installed = True


def on_ppo_trainer_module(module) -> None:
    from zorro_verl.integrations.openrlhf.actor import with_trainer_metrics
    from zorro_verl.integrations.openrlhf.batching import make_balance_experiences

    settings = settings_from_env()
    if settings.group_balance:
        module.balance_experiences = make_balance_experiences(settings.group_balance_mode)
    cls = module.BasePPOTrainer
    if not getattr(cls, "_zorro_installed", False):
        cls.train_step = with_trainer_metrics(cls.train_step)
        cls._zorro_installed = True


def on_ppo_actor_module(module) -> None:
    from zorro_verl.integrations.openrlhf.actor import with_zorro_metrics
    from zorro_verl.integrations.openrlhf.batching import install_training_batches

    cls = module.ActorPPOTrainer
    if not getattr(cls, "_zorro_installed", False):
        cls.ppo_train = with_zorro_metrics(cls.ppo_train)
        install_training_batches(module, settings_from_env())
        cls._zorro_installed = True


def on_model_actors_module(module) -> None:
    from zorro_verl.integrations.openrlhf.actor import install_model_actor_counts

    install_model_actor_counts(module.BaseModelActor)


def _probe_worker():
    # runs in the worker; unpickling this function imports this module there, so ask whether install() ran
    return _installed


def workers_have_switch(runtime_env: Optional[dict] = None) -> bool:
    """Whether a Ray worker of this job (started like OpenRLHF's actors, in the job's runtime env; ``runtime_env``
    overrides it, for tests) loaded zorro's loader. One zero-CPU task; needs ``ray.init`` done."""
    import ray

    task = ray.remote(num_cpus=0)(_probe_worker)
    if runtime_env is not None:
        task = task.options(runtime_env=runtime_env)
    return bool(ray.get(task.remote()))


def check_workers(runtime_env: Optional[dict] = None) -> None:
    """Raise if this process has the switch on but the job's Ray workers do not (e.g. ``ZORRO_OPENRLHF`` exported
    in the driver's shell only, while the cluster was started without it): they would train the stock way."""
    import ray

    if not ray.is_initialized():
        return
    if not workers_have_switch(runtime_env):
        raise ValueError(f"{ENV_SWITCH} is on in the driver but not in the Ray workers, which would run OpenRLHF's "
                         "stock forward. Pass it to the job: ray job submit --runtime-env-json "
                         f"'{{\"env_vars\": {{\"{ENV_SWITCH}\": \"1\"}}}}' (or export it before `ray start`), and "
                         "install the loader (zorro-verl openrlhf install) in the workers' environment.")
    logger.info("zorro: Ray workers of this job load the OpenRLHF loader")


# ---------------------------------------------------------------------------------------------- the .pth file
def pth_path(site_packages: Optional[str] = None) -> Path:
    """Where the loader goes: this environment's site-packages (``purelib``) unless given."""
    return Path(site_packages or sysconfig.get_paths()["purelib"]) / PTH_NAME


def install_pth(site_packages: Optional[str] = None) -> Path:
    """Write the loader's ``.pth`` file (idempotent); returns its path."""
    path = pth_path(site_packages)
    path.write_text(PTH_LINE)
    return path


def uninstall_pth(site_packages: Optional[str] = None) -> Optional[Path]:
    """Remove the loader's ``.pth`` file; returns its path if there was one."""
    path = pth_path(site_packages)
    if path.exists():
        path.unlink()
        return path
    return None


def main(argv=None) -> int:
    """``zorro-verl openrlhf {install,uninstall,status}``: the loader's .pth file in this environment."""
    argv = list(argv or [])
    usage = ("usage: zorro-verl openrlhf {install,uninstall,status}   (the loader every OpenRLHF process of this "
             f"environment runs; zorro is then switched on per run with {ENV_SWITCH}=1)")
    if len(argv) != 1 or argv[0] not in ("install", "uninstall", "status"):
        print(usage)
        return 0 if argv in (["-h"], ["--help"]) else 2
    if argv[0] == "install":
        print(f"zorro: OpenRLHF loader written to {install_pth()}; set {ENV_SWITCH}=1 in the job's environment")
    elif argv[0] == "uninstall":
        path = uninstall_pth()
        print(f"zorro: removed {path}" if path else f"zorro: no loader at {pth_path()}")
    else:
        path = pth_path()
        ok = path.exists() and path.read_text() == PTH_LINE
        print(f"zorro: OpenRLHF loader {'installed' if ok else 'NOT installed'} at {path}; "
              f"{ENV_SWITCH}={'on' if _switch() else 'off'} in this shell")
        return 0 if ok else 1
    return 0


def _switch() -> bool:
    from zorro_verl.integrations.openrlhf.settings import switch_on

    return switch_on()
