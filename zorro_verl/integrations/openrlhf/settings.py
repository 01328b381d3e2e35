"""The OpenRLHF switch: environment variables, read in every process (docs/design/openrlhf.md). Imports no OpenRLHF.

* ``ZORRO_OPENRLHF=1`` (also ``true``/``yes``/``on``): the switch. With it, the loader (:mod:`.boot`, run by the
  ``zorro_verl_openrlhf.pth`` file at interpreter start) hooks OpenRLHF's modules when they are imported; unset or
  ``0``, nothing of zorro is imported at all.
* ``ZORRO_OPENRLHF_OPTIONS="key=value,key=value"``: the same keys as verl's ``zorro`` node
  (:class:`~zorro_verl.integrations.verl.settings.ZorroSettings`: ``attention_backend``, ``logits_optimization``,
  ``on_unsupported``, ``rollout_n``, ``group_balance``; ``enable`` comes from the switch), plus the loader's own
  ``version_check=raise|warn`` (:func:`loader_options`: what an OpenRLHF version outside the tested ones does).
  Unknown keys and bad values raise ``ValueError`` naming the key.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

from zorro_verl.integrations.verl.settings import SETTING_KEYS, ZorroSettings

__all__ = ["ENV_SWITCH", "ENV_OPTIONS", "FIX_HINT", "LOADER_KEYS", "switch_on", "settings_from_env", "loader_options"]

ENV_SWITCH = "ZORRO_OPENRLHF"
ENV_OPTIONS = "ZORRO_OPENRLHF_OPTIONS"
#: Quoted in every refusal (:func:`~zorro_verl.integrations.verl.common.report_unsupported`).
FIX_HINT = (f"disable zorro (unset {ENV_SWITCH}), or add on_unsupported=warn to {ENV_OPTIONS} to run OpenRLHF's "
            "stock forward for such calls")
_TRUE = ("1", "true", "yes", "on")  # = loader.ON_VALUES / OFF_VALUES (the loader imports nothing of zorro)
_FALSE = ("", "0", "false", "no", "off")
#: Options of the loader itself (not verl's keys): name -> allowed values, the first the default.
LOADER_KEYS = {"version_check": ("raise", "warn")}


def switch_on(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether ``ZORRO_OPENRLHF`` switches zorro on; a value that is neither on nor off raises ``ValueError``."""
    raw = (os.environ if environ is None else environ).get(ENV_SWITCH, "")
    v = raw.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError(f"{ENV_SWITCH}: expected 1/true/yes/on or 0/false/no/off (or unset), got {raw!r}. Set "
                     f"{ENV_SWITCH}=1 to run zorro, or unset it to train stock.")


def _parse_options(env: Mapping[str, str]) -> tuple:
    """``ZORRO_OPENRLHF_OPTIONS`` split into (verl's keys, the loader's keys), both validated."""
    items: dict = {}
    loader = {k: allowed[0] for k, allowed in LOADER_KEYS.items()}
    for part in env.get(ENV_OPTIONS, "").split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key:
            raise ValueError(f"{ENV_OPTIONS}: expected comma-separated key=value pairs, got {part!r} in "
                             f"{env.get(ENV_OPTIONS)!r}; keys: {[k for k in SETTING_KEYS if k != 'enable']} "
                             f"and {list(LOADER_KEYS)}.")
        if key == "enable":
            raise ValueError(f"{ENV_OPTIONS}: 'enable' is set by {ENV_SWITCH}, not here.")
        if key in LOADER_KEYS:
            if value.lower() not in LOADER_KEYS[key]:
                raise ValueError(f"{ENV_OPTIONS}: {key} expects one of {list(LOADER_KEYS[key])}, got {value!r}.")
            loader[key] = value.lower()
            continue
        if key == "rollout_n":
            value = None if value.lower() in ("null", "none") else _as_int(key, value)
        items[key] = value
    items["enable"] = switch_on(env)
    return ZorroSettings.from_mapping(items), loader


def settings_from_env(environ: Optional[Mapping[str, str]] = None) -> ZorroSettings:
    """Validated settings from ``ZORRO_OPENRLHF`` and ``ZORRO_OPENRLHF_OPTIONS``."""
    return _parse_options(os.environ if environ is None else environ)[0]


def loader_options(environ: Optional[Mapping[str, str]] = None) -> dict:
    """The loader's own options from ``ZORRO_OPENRLHF_OPTIONS`` (:data:`LOADER_KEYS`, defaults filled in)."""
    return _parse_options(os.environ if environ is None else environ)[1]


def _as_int(key: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{ENV_OPTIONS}: {key} expects an integer, got {value!r}.") from None
