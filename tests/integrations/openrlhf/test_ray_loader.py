"""Is zorro on where OpenRLHF's work runs? A real local Ray cluster started by this module *without* the switch (as
a ``ray start`` in a shell that never exported it), drivers in fresh interpreters of .venv-openrlhf (so its real
``.pth`` loader runs at their start-up, and in every Ray worker), OpenRLHF's own ``RayActorGroup``,
``PolicyModelActor``, ``ReferenceModelActor`` and ``RemoteExperienceMaker``:

* the switch only in the driver's environment: the driver's ``RayActorGroup`` finds the policy actor without zorro
  and the launch fails with the reason and the fix;
* the switch in the job's runtime env (and the driver's, as ``ray job submit --runtime-env-json`` gives both):
  every actor confirms, and each runs zorro's ``Actor.forward``; a worker that never imports OpenRLHF loaded only
  the standard-library loader;
* the switch reaching the trainer actor but not the model actors (a driver without it): the experience maker, in
  the trainer actor where OpenRLHF 0.11.2 runs it, refuses at construction.

The trainer actor here is a small Ray actor that constructs OpenRLHF's ``RemoteExperienceMaker`` as OpenRLHF's
``PPOTrainer`` does (the real one also loads a tokenizer and a dataset). The model actors are created but not
initialised (no DeepSpeed engine, no model): the checks run at their creation, before any model exists. vLLM is
replaced by tests/support/openrlhf_ray_stubs (GPU-only; no engine is started).
"""

import importlib.metadata as md
import json
import os
import subprocess
import sys

import pytest

from tests.integrations.openrlhf.conftest import REPO_ROOT, STUBS, require_openrlhf_env
from tests.support import HANG_TIMEOUT_S

require_openrlhf_env()
# openrlhf.trainer.ray imports these at module import time (vLLM is stood in for, see the module docstring)
_MISSING = []
for _dist in ("deepspeed", "torchdata", "aiohttp", "pillow"):
    try:
        md.version(_dist)
    except md.PackageNotFoundError:
        _MISSING.append(_dist)
if _MISSING:  # setup_openrlhf_env.sh installs them: an environment without them is broken, not skippable
    raise ImportError(f"openrlhf.trainer.ray needs {_MISSING} in .venv-openrlhf; rebuild it with "
                      "scripts/setup_openrlhf_env.sh")

import ray  # noqa: E402

from zorro_verl.integrations.openrlhf import boot  # noqa: E402

VLLM_STUB = REPO_ROOT / "tests" / "support" / "openrlhf_ray_stubs"

DRIVER = r'''
import json, sys
from types import SimpleNamespace
import ray

scenario = sys.argv[1]
job_env = {"TOKENIZERS_PARALLELISM": "true"}  # what openrlhf.cli.train_ppo_ray's ray.init passes
if scenario == "runtime_env":
    job_env["ZORRO_OPENRLHF"] = "1"
ray.init(runtime_env={"env_vars": job_env}, log_to_driver=False)  # joins the cluster at RAY_ADDRESS

from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
from openrlhf.trainer.ray.launcher import RayActorGroup, ReferenceModelActor
from openrlhf.trainer.ray.ppo_actor import PolicyModelActor


@ray.remote
class Trainer:
    """Makes OpenRLHF's experience maker in its own Ray actor, as PPOTrainer does."""

    def __init__(self, actor_group, ref_group):
        ns = SimpleNamespace
        args = ns(algo=ns(advantage=ns(estimator="group_norm")), actor=ns(aux_loss_coef=0.0),
                  ds=ns(ring_attn_size=1, tensor_parallel_size=1, lora=ns(rank=0)))
        self.maker = RemoteExperienceMaker(actor_group, None, None, ref_group, None, ns(args=args), None)

    def status(self):
        from zorro_verl.integrations.openrlhf.boot import worker_status

        return worker_status()


@ray.remote(num_cpus=0)
def light_worker():
    """A worker of the job that never imports OpenRLHF (like Ray's own processes)."""
    import sys

    heavy = {"torch", "zorro_verl", "transformers", "openrlhf", "wrapt"}
    return sorted({m.split(".")[0] for m in sys.modules} & heavy), "zorro_verl_openrlhf_loader" in sys.modules


policy = RayActorGroup(1, 1, PolicyModelActor, num_gpus_per_actor=0.25)  # OpenRLHF's launch order
if scenario == "trainer_only":
    trainer = Trainer.options(runtime_env={"env_vars": dict(job_env, ZORRO_OPENRLHF="1")}).remote(policy, None)
    ray.get(trainer.__ray_ready__.remote())
    raise SystemExit("unreachable: the trainer's experience maker must refuse")
ref = RayActorGroup(1, 1, ReferenceModelActor, num_gpus_per_actor=0.25)
from zorro_verl.integrations.openrlhf.boot import on_trainer_check_module, worker_status

# the hook that checks OpenRLHF's PPOTrainer at its creation, applied to this trainer actor class
on_trainer_check_module(SimpleNamespace(__name__="openrlhf.trainer.ppo_trainer", PPOTrainer=Trainer))
trainer = Trainer.remote(policy, ref)

out = {"driver": worker_status(), "trainer": ray.get(trainer.status.remote()),
       "actors": ray.get([h.__ray_call__.remote(worker_status) for h in policy._actor_handlers + ref._actor_handlers]),
       "light": ray.get(light_worker.remote())}
print("RESULT " + json.dumps(out))
'''


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One local cluster for the module, started from this (switch-less) process: its raylet and every worker
    inherit this environment. The path: the repository, flash-attn's stand-ins, vLLM's stand-in."""
    links = tmp_path_factory.mktemp("paths")
    (links / "flash_attn").symlink_to(STUBS / "flash_attn")
    (links / "vllm").symlink_to(VLLM_STUB / "vllm")
    path = os.pathsep.join([str(REPO_ROOT), str(links)])
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = path
    assert os.environ.get("ZORRO_OPENRLHF") in (None, "", "0")
    try:
        info = ray.init(address="local", num_cpus=4, num_gpus=4, include_dashboard=False, log_to_driver=False)
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = saved
    try:
        yield {"address": info.address_info["gcs_address"], "path": path}
    finally:
        ray.shutdown()


def drive(cluster, scenario, switch=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZORRO_OPENRLHF", "RAY_"))}
    env.update(PYTHONPATH=cluster["path"], RAY_ADDRESS=cluster["address"])
    if switch is not None:
        env["ZORRO_OPENRLHF"] = switch
    return subprocess.run([sys.executable, "-c", DRIVER, scenario], env=env, capture_output=True, text=True,
                          timeout=HANG_TIMEOUT_S)


def test_loader_installed_in_this_environment():
    """The files `zorro-verl openrlhf install` wrote (scripts/test_openrlhf.sh refreshes them: they are code)."""
    status = boot.local_status()
    assert (status["pth"], status["loader"]) == ("ok", "ok"), status
    assert os.environ.get("ZORRO_OPENRLHF") in (None, "", "0")  # the test process itself runs without the switch


def test_switch_only_in_the_driver_fails_loudly(cluster):
    out = drive(cluster, "driver_only", switch="1")
    assert out.returncode == 1 and "RESULT" not in out.stdout
    err = out.stderr
    assert "RuntimeError: zorro is on in this process" in err and "RayActorGroup" in err, err[-3000:]
    assert "PolicyModelActor rank 0" in err and "zorro is not loaded there (ZORRO_OPENRLHF=None" in err
    assert "--runtime-env-json" in err  # the fix


def test_switch_through_the_runtime_env_runs(cluster):
    out = drive(cluster, "runtime_env", switch="1")
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.split("RESULT ", 1)[1])
    want = res["driver"]["settings"]
    assert res["driver"]["installed"] and want.startswith("ZorroSettings(enable=True")
    for status in [res["trainer"], *res["actors"]]:
        assert status["installed"] and status["settings"] == want and status["pid"] != res["driver"]["pid"]
        assert status["forward"] == boot.ZORRO_FORWARD, status
    assert len(res["actors"]) == 2
    assert res["light"] == [[], True]  # the switch set, OpenRLHF never imported: only the standard-library loader
    for checked in ("1 PolicyModelActor actor(s) run zorro with this process's settings (checked by RayActorGroup)",
                    "1 ReferenceModelActor actor(s) run zorro with this process's settings (checked by RayActorGroup)",
                    "1 PPOTrainer actor(s) run zorro with this process's settings (checked by PPOTrainer.remote)"):
        assert f"[zorro] {checked}" in out.stderr, out.stderr[-3000:]


def test_trainer_refuses_model_actors_without_zorro(cluster):
    """The check runs where the experience maker runs (the trainer actor), even with a switch-less driver."""
    out = drive(cluster, "trainer_only", switch=None)
    assert out.returncode == 1 and "unreachable" not in out.stderr
    err = out.stderr
    assert "zorro is on in this process" in err and "the experience maker" in err, err[-3000:]
    assert "PolicyModelActor rank 0" in err


def test_status_asks_the_cluster(cluster):
    """`zorro-verl openrlhf status --address`: what a job's workers on each node load, with and without the job's
    runtime env."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZORRO_OPENRLHF", "RAY_"))}
    env["PYTHONPATH"] = cluster["path"]
    cmd = [sys.executable, "-m", "zorro_verl.cli", "openrlhf", "status", "--address", cluster["address"]]
    off = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=HANG_TIMEOUT_S)
    assert off.returncode == 1 and "NOT ON" in off.stdout and "ZORRO_OPENRLHF=None" in off.stdout, off.stdout
    on = boot.cluster_status(runtime_env={"env_vars": {"ZORRO_OPENRLHF": "1"}})
    assert len(on) == 1 and on[0]["installed"] and on[0]["import_openrlhf"] == "ok", on
    assert on[0]["files"]["pth"] == on[0]["files"]["loader"] == "ok"
