"""The start-up half of the OpenRLHF loader (docs/design/openrlhf.md): standard library only, so that a process with the
switch exported (every Ray daemon when it is exported before ``ray start``) loads nothing heavy.

``zorro-verl openrlhf install`` copies this file into site-packages as ``zorro_verl_openrlhf_loader.py`` beside
``zorro_verl_openrlhf.pth``, whose one line imports it and calls :func:`arm` when ``ZORRO_OPENRLHF`` is set to
anything but an off value (unset, ``0``, ``false``, ``no``, ``off``). The copy stays when ``pip uninstall
zorro-verl`` removes the package, so a switched-on process can still say that zorro is gone.

:func:`arm` only puts a finder first on ``sys.meta_path``. The first import of ``openrlhf`` in the process then runs
``zorro_verl.integrations.openrlhf.boot.start``: it validates the switch, the options and OpenRLHF's version and
registers the post-import hooks. Any failure there (a bad value, zorro missing or older than this loader, an
untested OpenRLHF) is raised by that ``import`` statement — where Python reports it and the process stops —
instead of at interpreter start-up, where ``site`` prints a ``.pth`` line's exception and carries on. Until it
succeeds every later import of ``openrlhf`` raises it again, so no process runs OpenRLHF stock with the switch on.
"""

import os
import sys

#: Passed to ``boot.start``, which refuses a loader copied by another zorro-verl (bumped when this file changes
#: in a way the boot code depends on).
LOADER_VERSION = 1
ENV_SWITCH = "ZORRO_OPENRLHF"
OFF_VALUES = ("", "0", "false", "no", "off")
ON_VALUES = ("1", "true", "yes", "on")


class ZorroLoaderError(RuntimeError):
    """zorro is switched on for OpenRLHF in this process but cannot run."""


def switch_set(environ=None) -> bool:
    """Whether ``ZORRO_OPENRLHF`` asks for zorro (any value but an off one: bad values are refused at boot)."""
    return (os.environ if environ is None else environ).get(ENV_SWITCH, "").strip().lower() not in OFF_VALUES


class OpenRLHFFinder:
    """A ``sys.meta_path`` entry that boots zorro when ``openrlhf`` is first imported; it finds no module itself."""

    def __init__(self):
        self.booted = False
        self.error = None  # the boot failure, raised again at every import of openrlhf
        self._busy = False

    def find_spec(self, name, path=None, target=None):
        if name != "openrlhf" or self.booted or self._busy:
            return None
        if self.error is not None:
            raise self.error
        self._busy = True
        try:
            _boot()
        except Exception as e:
            self.error = e
            raise
        finally:
            self._busy = False
        self.booted = True
        return None  # the ordinary finders import OpenRLHF, now with zorro's post-import hooks registered


def _boot() -> None:
    import importlib
    import importlib.util

    value = os.environ.get(ENV_SWITCH, "")
    if value.strip().lower() not in ON_VALUES:  # checked here, before anything heavy is imported
        raise ValueError(f"{ENV_SWITCH}: expected 1/true/yes/on or 0/false/no/off (or unset), got {value!r}. Set "
                         f"{ENV_SWITCH}=1 to run zorro, or unset it to train stock.")
    if importlib.util.find_spec("zorro_verl") is None:
        here = os.path.dirname(os.path.abspath(__file__))
        raise ZorroLoaderError(
            f"{ENV_SWITCH}={os.environ.get(ENV_SWITCH)!r} switches zorro on for OpenRLHF, but the zorro_verl package "
            f"is not installed for {sys.executable}: its loader ({os.path.join(here, 'zorro_verl_openrlhf.pth')} and "
            f"{os.path.abspath(__file__)}) was left behind. Install zorro-verl into this environment, or unset "
            f"{ENV_SWITCH} to train stock, or delete those two files.")
    # by name: this code runs as the site-packages copy, outside the package it enters here
    importlib.import_module("zorro_verl.integrations.openrlhf.boot").start(LOADER_VERSION)


def finder():
    """The armed finder of this process, or None."""
    return next((f for f in sys.meta_path if isinstance(f, OpenRLHFFinder)), None)


def arm() -> None:
    """Called by the ``.pth`` line: boot zorro at the first import of ``openrlhf`` (idempotent)."""
    if finder() is None:
        sys.meta_path.insert(0, OpenRLHFFinder())
