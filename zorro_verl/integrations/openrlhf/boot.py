"""The OpenRLHF loader: post-import hooks installed in every Python process of the environment that imports
OpenRLHF with the switch on, and the checks that every process doing OpenRLHF work has them (docs/design/openrlhf.md).

OpenRLHF has no plugin entry points and runs its work in Ray actors (the ``PPOTrainer`` actor that makes the
experiences, the policy, reference, critic and reward model actors), each a separate Python process started by
Ray's raylet. The one code path that runs in *every* such process, however the job is launched (``ray job
submit``, a plain ``python -m openrlhf.cli.train_ppo_ray`` that starts a local cluster, or a driver joining a ``ray
start`` cluster), is the interpreter's start-up: ``site`` executes the ``import`` lines of every ``.pth`` file in
site-packages. :func:`install_pth` writes ``zorro_verl_openrlhf.pth`` and the standard-library-only
``zorro_verl_openrlhf_loader.py`` (:mod:`.loader`) there (``zorro-verl openrlhf install``). With ``ZORRO_OPENRLHF``
set, the ``.pth`` line only arms a finder; the process's first ``import openrlhf`` calls :func:`start`, which
validates the switch, ``ZORRO_OPENRLHF_OPTIONS`` and OpenRLHF's version and registers ``wrapt`` post-import hooks
(:func:`install`); a failure is raised by that import, so the process stops with the reason instead of training
stock. Processes that never import OpenRLHF (Ray's daemons) import neither torch nor zorro.

Each hook patches one OpenRLHF module when, and where, it is imported:

* ``openrlhf.models.actor`` — ``Actor.forward`` -> :func:`~.actor.zorro_forward` (actor training, old log-probs,
  reference, EMA);
* ``openrlhf.trainer.ppo_utils.replay_buffer`` — dynamic batching's per-step partitions regrouped on the actor's
  buffer (:func:`~.batching.install_replay_buffer`);
* ``openrlhf.trainer.ppo_utils.experience_maker`` — ``RemoteExperienceMaker``: the start-up checks (OpenRLHF's
  arguments; that the model actors it drives run zorro, :func:`confirm_actors`) and
  :func:`~.batching.split_rollout_samples`;
* ``openrlhf.trainer.ppo_trainer`` — :func:`~.batching.balance_experiences` (dynamic batching's DP balancing) and
  the trainer's metrics (:func:`~.actor.with_trainer_metrics`) and the check of the ``PPOTrainer`` actor at its
  creation; ``openrlhf.trainer.ppo_trainer_async`` likewise for ``PPOTrainerAsync``;
* ``openrlhf.trainer.ray.ppo_actor`` — training micro-batches regrouped inside each optimizer step
  (:func:`~.batching.install_training_batches`); ``zorro/*`` metrics in the status OpenRLHF logs after each step;
* ``openrlhf.trainer.ray.launcher`` — ``RayActorGroup`` checks the actors it creates; ``BaseModelActor.zorro_counts``
  (the reference model's counters).

``group_balance=false`` in ``ZORRO_OPENRLHF_OPTIONS`` leaves OpenRLHF's batching alone (only the forward changes).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
import sysconfig
from pathlib import Path
from typing import Optional

from zorro_verl.integrations.openrlhf import loader as _loader
from zorro_verl.integrations.openrlhf.settings import ENV_OPTIONS, ENV_SWITCH, loader_options, settings_from_env

__all__ = ["start", "install", "PTH_NAME", "PTH_LINE", "LOADER_NAME", "LOADER_MODULE", "LOADER_VERSION",
           "TESTED_OPENRLHF", "check_openrlhf_version", "announce", "install_pth", "uninstall_pth", "pth_path",
           "loader_path", "loader_source", "local_status", "worker_status", "confirm_actors", "cluster_status", "main",
           "on_actor_module", "on_replay_buffer_module", "on_experience_maker_module", "on_ppo_trainer_module",
           "on_model_actors_module", "on_trainer_check_module", "on_launcher_module", "on_ppo_actor_module"]

logger = logging.getLogger(__name__)

PTH_NAME = "zorro_verl_openrlhf.pth"
LOADER_MODULE = "zorro_verl_openrlhf_loader"
LOADER_NAME = LOADER_MODULE + ".py"
LOADER_VERSION = _loader.LOADER_VERSION
#: ``site`` executes a .pth line that starts with ``import``; with the switch unset or off it is string work only,
#: with it set it imports the standard-library-only loader (no torch, no zorro) and arms its finder.
PTH_LINE = (f"import os; os.environ.get({ENV_SWITCH!r}, '').strip().lower() not in {_loader.OFF_VALUES!r} and "
            f"__import__({LOADER_MODULE!r}).arm()\n")
#: The OpenRLHF releases whose methods the hooks were written against and tested with.
TESTED_OPENRLHF = ("0.11.2",)
FIX_SWITCH = (f"Pass {ENV_SWITCH} (and {ENV_OPTIONS}) to every process of the job: `ray job submit --runtime-env-json "
              f"'{{\"env_vars\": {{\"{ENV_SWITCH}\": \"1\"}}}}' -- python3 -m openrlhf.cli.train_ppo_ray ...`, or "
              f"export it in the shell that runs `ray start` on every node; install zorro-verl and run `zorro-verl "
              f"openrlhf install` in the workers' Python environment. `zorro-verl openrlhf status --address <ray "
              f"address>` shows what each node loads.")

_installed = False
_settings = None


def start(loader_version: int) -> None:
    """Called by the loader at this process's first ``import openrlhf``: refuse a stale loader, then
    :func:`install`. Raises with the reason and the fix; the ``import`` statement re-raises it."""
    if loader_version != LOADER_VERSION:
        raise _loader.ZorroLoaderError(
            f"{ENV_SWITCH}: the OpenRLHF loader in this environment (version {loader_version}) was written by "
            f"another zorro-verl than the installed one (loader version {LOADER_VERSION}); run `zorro-verl openrlhf "
            f"install` again.")
    install()


def install() -> None:
    """Validate the switch, the options and OpenRLHF's version, then register the post-import hooks
    (idempotent). Bad values raise ``ValueError`` naming the variable; an untested OpenRLHF raises
    :class:`~.loader.ZorroLoaderError` (or warns, with ``version_check=warn``)."""
    global _installed, _settings
    if _installed:
        return
    settings = settings_from_env()
    check_openrlhf_version(loader_options()["version_check"])
    import wrapt  # the `openrlhf` extra

    wrapt.register_post_import_hook(on_actor_module, "openrlhf.models.actor")
    wrapt.register_post_import_hook(on_experience_maker_module, "openrlhf.trainer.ppo_utils.experience_maker")
    wrapt.register_post_import_hook(on_ppo_actor_module, "openrlhf.trainer.ray.ppo_actor")
    wrapt.register_post_import_hook(on_ppo_trainer_module, "openrlhf.trainer.ppo_trainer")
    wrapt.register_post_import_hook(on_model_actors_module, "openrlhf.trainer.ray.launcher")
    wrapt.register_post_import_hook(on_launcher_module, "openrlhf.trainer.ray.launcher")
    wrapt.register_post_import_hook(on_trainer_check_module, "openrlhf.trainer.ppo_trainer")
    wrapt.register_post_import_hook(on_trainer_check_module, "openrlhf.trainer.ppo_trainer_async")
    if settings.group_balance:
        wrapt.register_post_import_hook(on_replay_buffer_module, "openrlhf.trainer.ppo_utils.replay_buffer")
    _settings = settings
    _installed = True
    announce(f"zorro is on for OpenRLHF {_openrlhf_version()} in pid {os.getpid()}: {settings!r}")


def announce(msg: str) -> None:
    """One line on stderr (and the log): the proof a user looks for that zorro is on. Printed, not only logged:
    OpenRLHF's processes configure logging after they import it, and Ray forwards its workers' stderr to the
    driver's terminal, prefixed with the actor's name and pid."""
    logger.info(msg)
    print(f"[zorro] {msg}", file=sys.stderr, flush=True)


def _openrlhf_version() -> Optional[str]:
    import importlib.metadata as md

    try:
        return md.version("openrlhf")
    except md.PackageNotFoundError:
        return None


def check_openrlhf_version(policy: str = "raise", version: Optional[str] = None) -> None:
    """Refuse (``policy="raise"``) or warn about an installed OpenRLHF outside :data:`TESTED_OPENRLHF`: the hooks
    replace whole methods of those releases. ``version`` overrides the installed one (tests)."""
    version = version or _openrlhf_version()
    if version is None or version in TESTED_OPENRLHF:
        return
    msg = (f"{ENV_SWITCH}: zorro's OpenRLHF plugin replaces whole methods of openrlhf {'/'.join(TESTED_OPENRLHF)} "
           f"(Actor.forward, the replay buffer's batching, the experience maker's split) and is tested with that "
           f"release only; this environment has openrlhf {version}. Install openrlhf=={TESTED_OPENRLHF[-1]}, or "
           f"unset {ENV_SWITCH} to train stock, or add version_check=warn to {ENV_OPTIONS} to run anyway (then "
           f"compare a training step against {ENV_SWITCH}=0 first).")
    if policy == "warn":
        logger.warning("zorro: %s", msg)
        return
    raise _loader.ZorroLoaderError(msg)


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
        # at trainer construction, before any rollout, in the process that makes the experiences
        check_args(self.strategy.args, settings_from_env())
        for role in ("actor_model_group", "initial_model_group", "critic_model_group", "reward_model_group"):
            group = getattr(self, role, None)
            if group is not None:
                confirm_actors(group._actor_handlers, _actor_name(group.ray_actor_type),
                               caller="the experience maker")

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


def on_launcher_module(module) -> None:
    """``RayActorGroup`` (policy, reference, critic, reward model actors) confirms each actor it creates."""
    cls = module.RayActorGroup
    if getattr(cls, "_zorro_installed", False):
        return
    init = cls.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        confirm_actors(self._actor_handlers, _actor_name(self.ray_actor_type), caller="RayActorGroup")

    cls.__init__ = __init__
    cls._zorro_installed = True


def _actor_name(actor_class) -> str:
    """``PolicyModelActor`` for Ray's ``ActorClass(PolicyModelActor)`` object."""
    cls = getattr(getattr(actor_class, "__ray_metadata__", None), "modified_class", None)
    return getattr(cls, "__name__", None) or str(actor_class)


#: The trainer actors the driver creates: checked at creation. (The async trainer's ``TrainingActor``, which makes
#: the experiences, is created inside ``PPOTrainerAsync`` from a pickled module global, which an override would
#: travel with; its experience maker checks the model actors.)
TRAINER_ACTORS = {"openrlhf.trainer.ppo_trainer": ("PPOTrainer",),
                  "openrlhf.trainer.ppo_trainer_async": ("PPOTrainerAsync",)}


def on_trainer_check_module(module) -> None:
    """``PPOTrainer.remote(...)`` (``PPOTrainerAsync.remote``) confirms the actor it creates. The override sits
    on the ``ActorClass`` object the module holds, so OpenRLHF's ``PPOTrainer.remote(...)`` call runs it."""
    for name in TRAINER_ACTORS.get(module.__name__, ()):
        actor_class = getattr(module, name, None)
        if actor_class is None or getattr(actor_class, "_zorro_checked", False):
            continue
        remote = actor_class.remote

        def checked_remote(*args, _remote=remote, _name=name, **kwargs):
            handle = _remote(*args, **kwargs)
            confirm_actors([handle], _name, caller=f"{_name}.remote")
            return handle

        actor_class.remote = checked_remote
        actor_class._zorro_checked = True


# ------------------------------------------------------------------------- is zorro on where the work runs?
def worker_status(actor=None) -> dict:
    """What this process loaded (run in a Ray worker: ``handle.__ray_call__`` passes the actor, a task nothing).
    JSON-able: ``pid``, ``node``, ``python``, ``switch``/``options`` (the raw variables), ``loader`` (the .pth's
    finder armed, booted, its error), ``installed``/``settings`` (:func:`install` ran, with what), ``forward``
    (``Actor.forward``'s module.name when ``openrlhf.models.actor`` is imported here), ``zorro`` (version)."""
    import importlib.metadata as md
    import socket

    try:
        zorro = md.version("zorro-verl")
    except md.PackageNotFoundError:  # a source checkout on the path
        zorro = None
    finder = None
    mod = sys.modules.get(LOADER_MODULE)
    if mod is not None:
        finder = mod.finder()
    forward = None
    actor_mod = sys.modules.get("openrlhf.models.actor")
    if actor_mod is not None:
        f = actor_mod.Actor.forward
        forward = f"{f.__module__}.{f.__name__}"
    return {"pid": os.getpid(), "node": socket.gethostname(), "python": sys.executable,
            "switch": os.environ.get(ENV_SWITCH), "options": os.environ.get(ENV_OPTIONS),
            "loader": None if finder is None else {"booted": finder.booted,
                                                    "error": None if finder.error is None else repr(finder.error)},
            "installed": _installed, "settings": repr(_settings) if _installed else None,
            "forward": forward, "zorro": zorro}


ZORRO_FORWARD = "zorro_verl.integrations.openrlhf.actor.zorro_forward"


def _problem(status: dict) -> Optional[str]:
    """Why a worker's :func:`worker_status` does not match this process's zorro, or None."""
    if not status["installed"]:
        if status["loader"] is not None and status["loader"]["error"]:
            return f"its loader failed: {status['loader']['error']}"
        return (f"zorro is not loaded there ({ENV_SWITCH}={status['switch']!r}; the .pth loader "
                f"{'ran' if status['loader'] is not None else 'did not run'})")
    if status["settings"] != repr(_settings):
        return (f"its settings differ: {status['settings']} there, {_settings!r} here ({ENV_OPTIONS}="
                f"{status['options']!r} there, {os.environ.get(ENV_OPTIONS)!r} here)")
    if status["forward"] is not None and status["forward"] != ZORRO_FORWARD:
        return f"its Actor.forward is {status['forward']}, not zorro's"
    return None


def confirm_actors(handles, role: str, caller: str = "zorro") -> None:
    """Ask each Ray actor in ``handles`` (one ``__ray_call__`` each, in parallel) whether it runs zorro with this
    process's settings; raise ``RuntimeError`` naming every one that does not (OpenRLHF would train it stock)."""
    import ray

    if _settings is None or not handles:
        return
    refs = [h.__ray_call__.remote(worker_status) for h in handles]
    bad = []
    for rank, ref in enumerate(refs):
        try:
            status = ray.get(ref)
        except ray.exceptions.RayActorError:
            raise  # the actor died (e.g. in its __init__): OpenRLHF's own error, not zorro's
        except Exception as e:  # e.g. zorro_verl not importable there
            bad.append(f"{role} rank {rank}: the check could not run there ({type(e).__name__}: "
                       f"{str(e).strip().splitlines()[-1] if str(e).strip() else ''})")
            continue
        why = _problem(status)
        if why is not None:
            bad.append(f"{role} rank {rank} (pid {status['pid']} on {status['node']}, {status['python']}): {why}")
    if bad:
        raise RuntimeError(f"zorro is on in this process (pid {os.getpid()}, {caller}) but not in every OpenRLHF "
                           f"actor of the job, which would train the stock way:\n  " + "\n  ".join(bad) +
                           f"\n{FIX_SWITCH}")
    announce(f"{len(handles)} {role} actor(s) run zorro with this process's settings (checked by {caller})")


# ---------------------------------------------------------------------------------------------- the .pth file
def _site(site_packages: Optional[str]) -> Path:
    return Path(site_packages or sysconfig.get_paths()["purelib"])


def pth_path(site_packages: Optional[str] = None) -> Path:
    """Where the loader's ``.pth`` goes: this environment's site-packages (``purelib``) unless given."""
    return _site(site_packages) / PTH_NAME


def loader_path(site_packages: Optional[str] = None) -> Path:
    """Where the loader module the ``.pth`` line imports goes (beside it)."""
    return _site(site_packages) / LOADER_NAME


def loader_source() -> str:
    """The text :func:`install_pth` writes as the loader module: :mod:`.loader`'s source."""
    return Path(_loader.__file__).read_text()


def install_pth(site_packages: Optional[str] = None) -> Path:
    """Write the loader module and its ``.pth`` file (idempotent; the module first, so the line never runs
    without it); returns the ``.pth``'s path."""
    loader_path(site_packages).write_text(loader_source())
    path = pth_path(site_packages)
    path.write_text(PTH_LINE)
    return path


def uninstall_pth(site_packages: Optional[str] = None) -> list:
    """Remove the ``.pth`` file and the loader module (the ``.pth`` first); returns the paths removed."""
    removed = []
    for path in (pth_path(site_packages), loader_path(site_packages)):
        if path.exists():
            path.unlink()
            removed.append(path)
    return removed


def local_status(site_packages: Optional[str] = None, environ=None) -> dict:
    """This environment's loader: ``pth`` and ``loader`` each ``"ok"``, ``"missing"`` or ``"stale"`` (written by
    another zorro-verl: run install again), and ``switch`` (``"on"``, ``"off"`` or the error a bad value raises)."""
    from zorro_verl.integrations.openrlhf.settings import switch_on

    def state(path: Path, want: str) -> str:
        return "missing" if not path.exists() else ("ok" if path.read_text() == want else "stale")

    env = os.environ if environ is None else environ
    try:
        settings_from_env(env)
        switch = "on" if switch_on(env) else "off"
    except ValueError as e:
        switch = f"invalid: {e}"
    return {"site_packages": str(_site(site_packages)), "pth": state(pth_path(site_packages), PTH_LINE),
            "loader": state(loader_path(site_packages), loader_source()), "switch": switch}


def _node_probe(check_import: bool) -> dict:
    """Runs in a Ray task on one node: the loader files of that worker's Python and what its start-up loaded;
    with ``check_import``, ``import openrlhf`` there (what an OpenRLHF actor would do first: boots zorro)."""
    import socket

    out = {"node": socket.gethostname(), "python": sys.executable, "switch": os.environ.get(ENV_SWITCH),
           "files": local_status(), "import_openrlhf": None}
    if check_import:
        try:
            if importlib.util.find_spec("openrlhf") is None:
                out["import_openrlhf"] = "openrlhf is not installed"
            else:
                import openrlhf  # noqa: F401  (boots zorro when the switch is set)

                out["import_openrlhf"] = "ok"
        except Exception as e:
            out["import_openrlhf"] = f"{type(e).__name__}: {e}"
    out.update({k: v for k, v in worker_status().items() if k in ("loader", "installed", "settings")})
    return out


def cluster_status(runtime_env: Optional[dict] = None, check_import: bool = True) -> list:
    """:func:`_node_probe` on every alive node of the connected Ray cluster (one zero-CPU task pinned to each, in
    ``runtime_env`` like a job's workers); needs ``ray.init`` done. Returns one dict per node."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0)(_node_probe)
    refs = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        opts = {"scheduling_strategy": NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)}
        if runtime_env is not None:
            opts["runtime_env"] = runtime_env
        refs.append(task.options(**opts).remote(check_import))
    return ray.get(refs)


def main(argv=None) -> int:
    """``zorro-verl openrlhf {install,uninstall,status}``: the loader in this environment; ``status --address``
    also asks every node of a Ray cluster what its workers load."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="zorro-verl openrlhf",
        description=f"The loader every OpenRLHF process of this environment runs; zorro is then switched on per run "
                    f"with {ENV_SWITCH}=1 (docs/design/openrlhf.md).")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("install", help="write the loader (.pth and its module) into this environment's site-packages")
    sub.add_parser("uninstall", help="remove them (do this before `pip uninstall zorro-verl`)")
    st = sub.add_parser("status", help="check the loader here and, with --address, on every node of a Ray cluster")
    st.add_argument("--address", default=None, help="a Ray cluster to check (e.g. auto, or ray://host:10001)")
    st.add_argument("--runtime-env-json", default=None,
                    help="the job's runtime env, as given to `ray job submit` (its env_vars reach the workers)")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    if args.cmd == "install":
        path = install_pth()
        print(f"zorro: OpenRLHF loader written to {path} and {loader_path()}; set {ENV_SWITCH}=1 in the job's "
              f"environment")
        return 0
    if args.cmd == "uninstall":
        removed = uninstall_pth()
        print(f"zorro: removed {', '.join(map(str, removed))}" if removed else f"zorro: no loader in {_site(None)}")
        return 0
    here = local_status()
    ok = here["pth"] == here["loader"] == "ok" and not here["switch"].startswith("invalid")
    print(f"zorro: this environment ({sys.executable}): .pth {here['pth']}, loader {here['loader']} in "
          f"{here['site_packages']}; {ENV_SWITCH} in this shell: {here['switch']}")
    if args.address is None:
        return 0 if ok else 1
    import ray

    runtime_env = json.loads(args.runtime_env_json) if args.runtime_env_json else None
    ray.init(address=args.address, logging_level=logging.WARNING, log_to_driver=False)
    try:
        nodes = cluster_status(runtime_env)
    finally:
        ray.shutdown()
    for n in nodes:
        files = n["files"]
        node_ok = (files["pth"] == files["loader"] == "ok" and bool(n["installed"])
                   and n["import_openrlhf"] in ("ok", None))
        ok = ok and node_ok
        print(f"zorro: node {n['node']} ({n['python']}): {'OK' if node_ok else 'NOT ON'} — .pth {files['pth']}, "
              f"loader {files['loader']}, {ENV_SWITCH}={n['switch']!r}, import openrlhf: {n['import_openrlhf']}, "
              f"zorro loaded: {bool(n['installed'])}" + (f" {n['settings']}" if n["settings"] else ""))
    if not ok:
        print(f"zorro: not on everywhere. {FIX_SWITCH}")
    return 0 if ok else 1
