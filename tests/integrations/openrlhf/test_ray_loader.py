"""The switch reaches OpenRLHF's Ray workers: real local Ray, the loader's .pth file installed in .venv-openrlhf
(scripts/setup_openrlhf_env.sh runs ``zorro-verl openrlhf install``), ``ZORRO_OPENRLHF`` passed the way a user
passes it to ``ray job submit --runtime-env-json`` (the job's ``runtime_env`` ``env_vars``).

A worker started with the switch has OpenRLHF's ``Actor.forward`` replaced as soon as it imports
``openrlhf.models.actor`` (nothing in the worker's code mentions zorro); a worker without it never imports zorro.
"""

import os

import pytest

from tests.integrations.openrlhf.conftest import REPO_ROOT, STUBS, require_openrlhf_env

require_openrlhf_env()

import ray  # noqa: E402

from zorro_verl.integrations.openrlhf.boot import PTH_LINE, check_workers, pth_path  # noqa: E402


@ray.remote
def probe_actor_forward():
    """Runs in a Ray worker: what OpenRLHF's Actor.forward is once OpenRLHF imports it."""
    booted = _loader_ran()  # before any OpenRLHF import
    from openrlhf.models.actor import Actor

    return booted, Actor.forward.__module__, Actor.forward.__name__


@ray.remote
def probe_boot():
    return _loader_ran(), os.environ.get("ZORRO_OPENRLHF")


def _loader_ran() -> bool:
    """Whether the .pth line ran the loader in this process (importing the module alone does not install it)."""
    import sys

    mod = sys.modules.get("zorro_verl.integrations.openrlhf.boot")
    return bool(mod is not None and mod._installed)


@pytest.fixture(scope="module")
def ray_session():
    path = os.pathsep.join([str(REPO_ROOT), str(STUBS)])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"ZORRO_OPENRLHF": "1", "PYTHONPATH": path}})
    try:
        yield path
    finally:
        ray.shutdown()


def test_loader_installed_in_this_environment():
    """The .pth file setup_openrlhf_env.sh wrote (what a process does with it: tests/.../test_switch.py)."""
    assert pth_path().read_text() == PTH_LINE
    assert os.environ.get("ZORRO_OPENRLHF") in (None, "", "0")  # the test process itself runs without the switch


def test_switch_reaches_ray_workers(ray_session):
    booted, module, name = ray.get(probe_actor_forward.remote(), timeout=300)
    assert booted
    assert (module, name) == ("zorro_verl.integrations.openrlhf.actor", "zorro_forward")


def test_worker_without_switch_imports_no_zorro(ray_session):
    off = probe_boot.options(runtime_env={"env_vars": {"ZORRO_OPENRLHF": "0", "PYTHONPATH": ray_session}})
    assert ray.get(off.remote(), timeout=300) == (False, "0")


def test_driver_check_sees_whether_workers_got_the_switch(ray_session):
    """The experience maker's start-up check (driver side): passes for this job, raises for workers without it."""
    check_workers()
    with pytest.raises(ValueError, match="not in the Ray workers"):
        check_workers(runtime_env={"env_vars": {"ZORRO_OPENRLHF": "0", "PYTHONPATH": ray_session}})
