"""The OpenRLHF switch: environment variables, read in every process (docs/DESIGN.md §12). Imports no OpenRLHF.

* ``ZORRO_OPENRLHF=1`` (also ``true``/``yes``/``on``): the switch. With it, the loader (:mod:`.boot`, run by the
  ``zorro_verl_openrlhf.pth`` file at interpreter start) hooks OpenRLHF's modules when they are imported; unset or
  ``0``, nothing of zorro is imported at all.
* ``ZORRO_OPENRLHF_OPTIONS="key=value,key=value"``: the same keys as verl's ``zorro`` node
  (:class:`~zorro_verl.integrations.verl.settings.ZorroSettings`: ``attention_backend``, ``logits_optimization``,
  ``on_unsupported``, ``rollout_n``, ``group_balance``; ``enable`` comes from the switch). Unknown keys and bad
  values raise ``ValueError`` naming the key.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

from zorro_verl.integrations.verl.settings import SETTING_KEYS, ZorroSettings

__all__ = ["ENV_SWITCH", "ENV_OPTIONS", "FIX_HINT", "switch_on", "settings_from_env"]

ENV_SWITCH = "ZORRO_OPENRLHF"
ENV_OPTIONS = "ZORRO_OPENRLHF_OPTIONS"
#: Quoted in every refusal (:func:`~zorro_verl.integrations.verl.common.report_unsupported`).
FIX_HINT = (f"disable zorro (unset {ENV_SWITCH}), or add on_unsupported=warn to {ENV_OPTIONS} to run OpenRLHF's "
            "stock forward for such calls")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def switch_on(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether ``ZORRO_OPENRLHF`` switches zorro on; a value that is neither on nor off raises ``ValueError``."""
    v = (os.environ if environ is None else environ).get(ENV_SWITCH, "").strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError(f"{ENV_SWITCH}: expected 1/true/yes/on or 0/false/no/off (or unset), got {v!r}.")


def settings_from_env(environ: Optional[Mapping[str, str]] = None) -> ZorroSettings:
    """Validated settings from ``ZORRO_OPENRLHF`` and ``ZORRO_OPENRLHF_OPTIONS``."""
    env = os.environ if environ is None else environ
    items: dict = {}
    for part in env.get(ENV_OPTIONS, "").split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key:
            raise ValueError(f"{ENV_OPTIONS}: expected comma-separated key=value pairs, got {part!r} in "
                             f"{env.get(ENV_OPTIONS)!r}; keys: {[k for k in SETTING_KEYS if k != 'enable']}.")
        if key == "enable":
            raise ValueError(f"{ENV_OPTIONS}: 'enable' is set by {ENV_SWITCH}, not here.")
        if key == "rollout_n":
            value = None if value.lower() in ("null", "none") else _as_int(key, value)
        items[key] = value
    items["enable"] = switch_on(env)
    return ZorroSettings.from_mapping(items)


def _as_int(key: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{ENV_OPTIONS}: {key} expects an integer, got {value!r}.") from None
