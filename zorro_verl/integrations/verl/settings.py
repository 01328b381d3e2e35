"""The ``zorro`` settings shared by both verl generations (docs/design/verl.md). Imports no verl.

Plain Python (no verl, no dataclass): :meth:`ZorroSettings.from_mapping` accepts a dict, an OmegaConf ``DictConfig``
or any object with the same attributes (e.g. the Hydra plugin dataclass), rejects unknown keys and bad values
with a ``ValueError`` naming the key, and returns a validated, immutable-by-convention settings object.

Keys (documented for users in ``configs/README.md``):

* ``enable`` (bool, False): run the deduplicated forward.
* ``rollout_n`` (int >= 1 or None): responses per prompt; a sizing hint for micro-batching (groups are always
  found from the token ids, so a wrong value never changes results).
* ``logits_optimization`` (``none|compute|memory``): how the LM head / log-softmax is materialised.
* ``attention_backend`` (``auto`` or any registered backend: ``sdpa|eager|standard|flash|flash_copyfree|flex``):
  ``auto`` = ``flash_copyfree`` where the flash backends can run (:func:`~zorro_verl.attention.flash_available`:
  CUDA and flash-attn or PyTorch's built-in flash kernels) and on CPU (PyTorch's CPU flash kernels), else ``sdpa``
  (logged once when that happens on CUDA); see :func:`resolve_attention_backend` for why.
* ``on_unsupported`` (``raise|warn``): what to do with a setting zorro cannot run exactly; ``warn`` falls back to
  the stock forward for that batch, warns once and counts it in ``zorro/fallback_batches``.
* ``group_balance`` (bool, True): group-aware DP balancing in the trainer (false: verl's own balancing only).
* ``group_balance_mode`` (``keep_minibatches|whole_groups``, ``keep_minibatches``): how the trainer places rows
  (verl 0.9). ``keep_minibatches``: every optimizer step gets exactly the rows verl's own balancing gives it; rows
  move between DP ranks only inside each mini-batch, so a group's rows there sit on one rank (the run equals
  stock's). ``whole_groups`` (opt-in, logged): whole groups are bin-packed into (rank, mini-batch) slots, which
  dedups more but changes which rows share an optimizer step (docs/design/packing.md).
* ``sharing`` (``prompt|prefix``, ``prompt``): share identical prompts, or every common prefix (the prefix tree:
  shared system prompts, earlier turns of multi-turn samples, shared response starts).
* ``min_shared_len`` (int >= 1, 64): ``sharing=prefix`` only: tokens a shared tree node must add over its parent
  (shorter common prefixes, e.g. a chat-template header, are recomputed instead of fragmenting the batch).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Optional

from zorro_verl.attention import BACKEND_NAMES, flash_available, get_backend
from zorro_verl.logprob import LOGITS_MODES
from zorro_verl.packing.tree import DEFAULT_MIN_SHARED_LEN, SHARING_MODES

__all__ = ["ZorroSettings", "settings_of", "SETTING_KEYS", "ATTENTION_BACKEND_CHOICES", "ON_UNSUPPORTED",
           "GROUP_BALANCE_MODES",
           "resolve_attention_backend", "engine_node_key"]

logger = logging.getLogger(__name__)

ATTENTION_BACKEND_CHOICES = ("auto",) + BACKEND_NAMES
ON_UNSUPPORTED = ("raise", "warn")
GROUP_BALANCE_MODES = ("keep_minibatches", "whole_groups")
SETTING_KEYS = ("enable", "rollout_n", "logits_optimization", "attention_backend", "on_unsupported",
                "group_balance", "group_balance_mode", "sharing", "min_shared_len")
#: Keys that may appear in a Hydra node beside the settings and are ignored here (Hydra's own).
_IGNORED_KEYS = ("_target_",)

_logged_auto_sdpa = False


def _mapping_items(cfg: Any) -> dict:
    """Turn a dict / OmegaConf node / attribute object into a plain dict (resolving interpolations)."""
    if cfg is None:
        return {}
    try:  # OmegaConf is optional here: verl brings it, the core package does not need it.
        from omegaconf import DictConfig, OmegaConf

        if isinstance(cfg, DictConfig):
            return dict(OmegaConf.to_container(cfg, resolve=True))
    except ImportError:
        pass
    if isinstance(cfg, Mapping):
        return dict(cfg)
    if hasattr(cfg, "__dict__"):
        return {k: v for k, v in vars(cfg).items() if not k.startswith("_") or k in _IGNORED_KEYS}
    raise TypeError(f"zorro config: expected a mapping (dict / OmegaConf DictConfig) or an object with attributes, "
                    f"got {type(cfg).__name__}.")


def _as_bool(key: str, v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.lower() in ("true", "false"):
        return v.lower() == "true"
    raise ValueError(f"zorro.{key}: expected true or false, got {v!r}.")


def _as_choice(key: str, v: Any, choices: tuple) -> str:
    if not isinstance(v, str) or v not in choices:
        raise ValueError(f"zorro.{key}: expected one of {list(choices)}, got {v!r}.")
    return v


class ZorroSettings:
    """Validated zorro settings. Build with :meth:`from_mapping` (or the keyword constructor, same checks)."""

    __slots__ = SETTING_KEYS

    def __init__(self, enable: bool = False, rollout_n: Optional[int] = None, logits_optimization: str = "none",
                 attention_backend: str = "auto", on_unsupported: str = "raise", group_balance: bool = True,
                 group_balance_mode: str = "keep_minibatches", sharing: str = "prompt",
                 min_shared_len: int = DEFAULT_MIN_SHARED_LEN):
        self.enable = _as_bool("enable", enable)
        if rollout_n is not None:
            if isinstance(rollout_n, bool) or not isinstance(rollout_n, int) or rollout_n < 1:
                raise ValueError(f"zorro.rollout_n: expected a positive int or null, got {rollout_n!r}. It defaults "
                                 "to ${actor_rollout_ref.rollout.n} in the preset.")
        self.rollout_n = rollout_n
        self.logits_optimization = _as_choice("logits_optimization", logits_optimization, LOGITS_MODES)
        self.attention_backend = _as_choice("attention_backend", attention_backend, ATTENTION_BACKEND_CHOICES)
        self.on_unsupported = _as_choice("on_unsupported", on_unsupported, ON_UNSUPPORTED)
        self.group_balance = _as_bool("group_balance", group_balance)
        self.group_balance_mode = _as_choice("group_balance_mode", group_balance_mode, GROUP_BALANCE_MODES)
        self.sharing = _as_choice("sharing", sharing, SHARING_MODES)
        if isinstance(min_shared_len, bool) or not isinstance(min_shared_len, int) or min_shared_len < 1:
            raise ValueError(f"zorro.min_shared_len: expected an int >= 1 (tokens a shared prefix-tree node must "
                             f"add), got {min_shared_len!r}.")
        self.min_shared_len = min_shared_len

    def plan_kwargs(self) -> dict:
        """The ``build_plan`` keywords of these settings (``sharing``, and ``min_shared_len`` for prefix trees)."""
        if self.sharing == "prefix":
            return {"sharing": "prefix", "min_shared_len": self.min_shared_len}
        return {"sharing": "prompt"}

    @classmethod
    def from_mapping(cls, cfg: Any) -> ZorroSettings:
        """Validate ``cfg`` (dict, OmegaConf node or attribute object). Unknown keys raise ``ValueError``."""
        items = _mapping_items(cfg)
        unknown = sorted(k for k in items if k not in SETTING_KEYS and k not in _IGNORED_KEYS)
        if unknown:
            raise ValueError(f"zorro config: unknown key(s) {unknown}; valid keys are {list(SETTING_KEYS)}. Check "
                             "the spelling in your YAML / command-line override.")
        return cls(**{k: v for k, v in items.items() if k in SETTING_KEYS})

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in SETTING_KEYS}

    def __eq__(self, other) -> bool:
        return isinstance(other, ZorroSettings) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        return "ZorroSettings(" + ", ".join(f"{k}={getattr(self, k)!r}" for k in SETTING_KEYS) + ")"

    def resolved_backend(self, device_type: str) -> str:
        """The plan backend for ``device_type`` ('cuda' / 'cpu' / ...); see :func:`resolve_attention_backend`."""
        return resolve_attention_backend(self.attention_backend, device_type)


def resolve_attention_backend(choice: str, device_type: str) -> str:
    """``auto`` -> ``flash_copyfree`` where the flash backends can run (CUDA with flash-attn or PyTorch's built-in
    flash kernels: the copy-free design needs only the varlen forward / backward with the log-sum-exp, which both
    providers have) and on CPU (PyTorch's CPU flash kernels); else ``sdpa`` (logged once on CUDA).

    The memory rule picks it: a zorro micro-batch is filled to the same token budget as a stock one but counts each
    prompt once, so it holds more rows; ``flash_copyfree`` keeps for backward what the stock flash path keeps per
    token (q/k/v, out, lse), so never more than stock at the same budget, while ``flash`` keeps each response's
    gathered copy of its prompt's K/V (1.8x stock's attention bytes at G = 2, n = 8, P = 512, R = 64, GQA 4:1;
    ``python -m zorro_verl.bench --memory``). ``flash`` stays an explicit choice (one response call instead of two
    plus a merge) for runs with memory to spare; ``sdpa``, the fallback without flash kernels, gathers like it.

    Explicit choices are returned unchanged once they can run here; an explicit one that cannot (``flash`` without
    CUDA or flash kernels, ``flex`` for training on CPU...) raises naming why.
    """
    global _logged_auto_sdpa
    _as_choice("attention_backend", choice, ATTENTION_BACKEND_CHOICES)
    if choice == "auto":
        if flash_available(device_type) or device_type == "cpu":
            return "flash_copyfree"
        if device_type == "cuda" and not _logged_auto_sdpa:
            _logged_auto_sdpa = True
            logger.warning("zorro: attention_backend=auto picked 'sdpa' on CUDA because no flash kernels are available "
                           "(neither flash-attn nor PyTorch's built-in flash attention). 'sdpa' copies each prompt's "
                           "K/V per response and keeps those copies for backward: at the same "
                           "ppo_max_token_len_per_gpu its attention may hold more memory than stock's. Install "
                           "flash-attn (pip install 'zorro-verl[flash]') for the copy-free 'flash_copyfree', or set "
                           "attention_backend: flex (copy-free, compiled).")
        return "sdpa"
    if not get_backend(choice).available(device_type):
        raise ValueError(f"zorro.attention_backend: {choice!r} cannot run forward and backward on device "
                         f"{device_type!r} here ({get_backend(choice).summary}). Use 'auto' or 'sdpa'.")
    return choice


def engine_node_key(strategy) -> str:
    """The key of a verl role's engine config node, where its ``zorro`` mapping lives, for the role's ``strategy``:
    ``megatron`` for verl's Megatron engine, ``fsdp_config`` otherwise."""
    return "megatron" if strategy == "megatron" else "fsdp_config"


def settings_of(engine_config) -> ZorroSettings:
    """Validated settings of an engine config (the ``_zorro_settings`` its ``__post_init__`` stored, else its
    ``zorro`` mapping); the disabled defaults for a stock config without one."""
    s = getattr(engine_config, "_zorro_settings", None)
    if isinstance(s, ZorroSettings):
        return s
    return ZorroSettings.from_mapping(getattr(engine_config, "zorro", None) or {})
