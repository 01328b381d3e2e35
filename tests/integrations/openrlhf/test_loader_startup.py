"""The OpenRLHF loader at interpreter start-up, through the real ``.pth`` mechanism: each case is a fresh interpreter
whose ``site.addsitedir`` processes a site directory holding the files ``zorro-verl openrlhf install`` writes (so
``site`` executes the ``.pth`` line exactly as at start-up, swallowing what it raises). Needs no OpenRLHF: the
loader acts when ``openrlhf`` is imported, before Python looks for it, so the refusals show here too (in the main
suite ``import openrlhf`` then ends in ``ModuleNotFoundError``, in .venv-openrlhf it imports).

"Loud or on": with the switch set a process either runs zorro or its ``import openrlhf`` raises the reason; with it
unset or off nothing of zorro is imported; with it set but OpenRLHF never imported (Ray's daemons) only the
standard-library loader is."""

import logging
import os
import subprocess
import sys

import pytest

from tests.support import HANG_TIMEOUT_S
from zorro_verl.integrations.openrlhf import boot, loader
from zorro_verl.integrations.openrlhf.boot import (
    LOADER_MODULE,
    PTH_LINE,
    check_openrlhf_version,
    install_pth,
    loader_path,
    local_status,
    pth_path,
    uninstall_pth,
)
from zorro_verl.integrations.verl.settings import ZorroSettings

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
HEAVY = ("torch", "zorro_verl", "wrapt", "transformers", "openrlhf")
SHOW_MODULES = ("import sys; print(sorted({m.split('.')[0] for m in sys.modules} & set(%r)), "
                f"{LOADER_MODULE!r} in sys.modules)" % (HEAVY,))
#: Imports openrlhf once catching what it raises (printed), then again uncaught: a refusal must stay a refusal.
IMPORT_TWICE = ("try:\n    import openrlhf\nexcept BaseException as e:\n    print('first:', type(e).__name__)\n"
                "import openrlhf\n")


def start(tmp_path, code, switch=None, options=None, zorro_installed=True):
    """Run ``code`` in a fresh interpreter after ``site.addsitedir`` on a directory holding the loader files.
    ``zorro_installed=False``: ``-S`` and no PYTHONPATH, so neither site-packages nor the repository is on the
    path — an environment whose zorro_verl was uninstalled with the loader left behind."""
    site_dir = tmp_path / "site"
    site_dir.mkdir(exist_ok=True)
    install_pth(str(site_dir))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZORRO_OPENRLHF") and k != "PYTHONPATH"}
    if switch is not None:
        env["ZORRO_OPENRLHF"] = switch
    if options is not None:
        env["ZORRO_OPENRLHF_OPTIONS"] = options
    flags = []
    if zorro_installed:
        env["PYTHONPATH"] = REPO_ROOT
    else:
        flags = ["-S"]  # `import site` below then adds only the directory given, not site-packages
    prog = "import site, sys; site.addsitedir(sys.argv[1])\n" + code
    return subprocess.run([sys.executable, *flags, "-c", prog, str(site_dir)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=HANG_TIMEOUT_S)


def test_start_up_imports_nothing_heavy(tmp_path):
    """Switch unset / off: nothing of zorro, not even the loader. Set (as when exported before ``ray start``): only
    the standard-library loader, even with bad options (checked when OpenRLHF is imported), so Ray's daemons stay
    light; nothing printed at start-up."""
    for switch, loaded in [(None, False), ("0", False), ("off", False), ("1", True), ("2", True)]:
        out = start(tmp_path, SHOW_MODULES, switch=switch, options="colour=red")
        assert out.returncode == 0 and out.stderr == "", (switch, out.stderr[-2000:])
        assert out.stdout.split("\n")[0] == f"[] {loaded}", (switch, out.stdout)


@pytest.mark.parametrize("switch,options,error,match", [
    ("2", None, "ValueError", "ZORRO_OPENRLHF: expected 1/true/yes/on"),  # refused by the loader: no torch import
    ("1", "colour=red", "ValueError", "unknown key"),  # the options' parser (every key's checks: test_switch.py)
])
def test_bad_switch_or_options_stop_the_openrlhf_import(tmp_path, switch, options, error, match):
    """A bad value is raised by the process's ``import openrlhf`` (and by every later one) instead of being printed
    by ``site`` while the process trains stock."""
    out = start(tmp_path, IMPORT_TWICE, switch=switch, options=options)
    assert out.returncode == 1
    assert out.stdout.strip() == f"first: {error}", out.stdout + out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(error) and match in last, out.stderr[-2000:]
    assert "Error processing line" not in out.stderr  # nothing raised at start-up, where site would swallow it


def test_missing_dependency_stops_the_openrlhf_import(tmp_path):
    """A dependency of the hooks missing (``wrapt``, the ``openrlhf`` extra; made unimportable the way Python
    itself supports, ``sys.modules[name] = None``): the process's ``import openrlhf`` raises it, again at the second
    import, instead of the process training stock."""
    code = "import sys\nsys.modules['wrapt'] = None  # import wrapt now raises ModuleNotFoundError\n" + IMPORT_TWICE
    out = start(tmp_path, code, switch="1")
    assert out.returncode == 1
    assert out.stdout.strip() == "first: ModuleNotFoundError", out.stdout + out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError") and "wrapt" in last, out.stderr[-2000:]
    assert "Error processing line" not in out.stderr


def test_switch_on_boots_zorro_at_the_openrlhf_import(tmp_path):
    code = ("try:\n    import openrlhf\nexcept ModuleNotFoundError:\n    pass  # the main suite: no OpenRLHF\n"
            "from zorro_verl.integrations.openrlhf import boot\nprint(boot._installed, repr(boot._settings))")
    out = start(tmp_path, code, switch="1", options="attention_backend=sdpa,group_balance=false")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout == f"True {ZorroSettings(enable=True, attention_backend='sdpa', group_balance=False)!r}\n"


def test_uninstalled_package_fails_loudly_with_the_switch_on(tmp_path):
    """``pip uninstall zorro-verl`` leaves the loader files (pip does not know them): switched on, the OpenRLHF
    import says so and how to fix it; switched off, the process starts and runs silently."""
    out = start(tmp_path, "print('started')\n" + IMPORT_TWICE, switch="1", zorro_installed=False)
    assert out.returncode == 1 and out.stdout.split("\n")[:2] == ["started", "first: ZorroLoaderError"], out.stdout
    last = out.stderr.strip().splitlines()[-1]
    assert "zorro_verl package is not installed" in last and str(tmp_path / "site" / boot.PTH_NAME) in last
    assert "unset ZORRO_OPENRLHF" in last
    for switch in (None, "0"):
        out = start(tmp_path, "print('started')", switch=switch, zorro_installed=False)
        assert (out.returncode, out.stdout, out.stderr) == (0, "started\n", "")


def test_install_status_uninstall(tmp_path):
    site_dir = str(tmp_path)
    assert local_status(site_dir, environ={})["pth"] == "missing"
    path = install_pth(site_dir)
    assert path == pth_path(site_dir) and path.read_text() == PTH_LINE
    assert loader_path(site_dir).read_text() == open(loader.__file__).read()
    assert local_status(site_dir, environ={}) == {"site_packages": site_dir, "pth": "ok", "loader": "ok",
                                                  "switch": "off"}
    assert local_status(site_dir, environ={"ZORRO_OPENRLHF": "1"})["switch"] == "on"
    assert local_status(site_dir, environ={"ZORRO_OPENRLHF": "2"})["switch"].startswith("invalid: ZORRO_OPENRLHF")
    loader_path(site_dir).write_text("# an older loader\n")
    assert local_status(site_dir, environ={})["loader"] == "stale"
    assert uninstall_pth(site_dir) == [path, loader_path(site_dir)]
    assert not path.exists() and not loader_path(site_dir).exists() and uninstall_pth(site_dir) == []


def test_stale_loader_is_refused():
    with pytest.raises(loader.ZorroLoaderError, match="run `zorro-verl openrlhf install` again"):
        boot.start(boot.LOADER_VERSION - 1)


def test_openrlhf_version_check(caplog):
    for tested in boot.TESTED_OPENRLHF:
        check_openrlhf_version("raise", tested)
    with pytest.raises(loader.ZorroLoaderError, match=r"openrlhf 0\.12\.0.*openrlhf==0\.11\.2.*version_check=warn"):
        check_openrlhf_version("raise", "0.12.0")
    with caplog.at_level(logging.WARNING):
        check_openrlhf_version("warn", "0.12.0")
    assert any("openrlhf 0.12.0" in r.getMessage() for r in caplog.records)


def test_what_the_actor_check_refuses(monkeypatch):
    """`confirm_actors`' verdict on an actor's `worker_status` (the Ray paths: test_ray_loader.py)."""
    here = ZorroSettings(enable=True)
    monkeypatch.setattr(boot, "_settings", here)
    ok = {"installed": True, "settings": repr(here), "forward": boot.ZORRO_FORWARD, "switch": "1", "options": None,
          "loader": {"booted": True, "error": None}}
    assert boot._problem(ok) is None
    assert boot._problem(dict(ok, forward=None)) is None  # OpenRLHF's Actor not imported there (yet)
    cases = [
        (dict(ok, installed=False, settings=None, switch=None, loader=None),
         "zorro is not loaded there (ZORRO_OPENRLHF=None; the .pth loader did not run)"),
        (dict(ok, installed=False, settings=None, loader={"booted": False, "error": "ValueError('bad')"}),
         "its loader failed: ValueError('bad')"),
        (dict(ok, settings=repr(ZorroSettings(enable=True, group_balance=False)), options="group_balance=false"),
         "its settings differ"),
        (dict(ok, forward="openrlhf.models.actor.forward"), "its Actor.forward is openrlhf.models.actor.forward"),
    ]
    for status, why in cases:
        assert boot._problem(status).startswith(why), boot._problem(status)
