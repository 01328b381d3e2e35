"""What both verl generations' zorro actors share (docs/design/verl.md): the settings-driven state, the loud
refusal of settings zorro cannot run exactly, and the dedup metrics. Imports no verl, so the OpenRLHF integration
(docs/design/openrlhf.md) builds on it too."""

from __future__ import annotations

import logging
from typing import Optional

from zorro_verl.integrations.verl.settings import ZorroSettings
from zorro_verl.logprob import DEFAULT_CHUNK

__all__ = ["ZorroActorMixin", "report_unsupported", "dedup_metrics", "setup_unsupported", "METRIC_KEYS",
           "VERL_FIX_HINT"]

#: The metrics every zorro actor reports (each step; lists of per-call values in verl 0.9).
METRIC_KEYS = ("zorro/dedup_ratio", "zorro/prompt_tokens_saved", "zorro/split_groups", "zorro/fallback_batches")


def dedup_metrics(ordinary_tokens: int, dedup_tokens: int, split_groups: int, fallback_batches: int) -> dict:
    """The :data:`METRIC_KEYS` values: tokens of the ordinary forward over tokens of the deduplicated one, prompt
    tokens saved, groups split across micro-batches, micro-batches run by the stock forward."""
    return {
        "zorro/dedup_ratio": ordinary_tokens / dedup_tokens if dedup_tokens else 1.0,
        "zorro/prompt_tokens_saved": float(ordinary_tokens - dedup_tokens),
        "zorro/split_groups": float(split_groups),
        "zorro/fallback_batches": float(fallback_batches),
    }


def setup_unsupported(ulysses_sp: int = 1, hf_config=None, *, ulysses_supported: bool = False,
                      vlm_supported: bool = False) -> Optional[str]:
    """Why a run with these settings cannot use zorro's deduplicated forward (both verl generations; also read by
    ``zorro-verl doctor`` from a composed config), or None: Ulysses sequence parallelism where the actor does not
    run it (``ulysses_supported``: the 0.9 engine does, the 0.7 legacy actor does not), vision-language models where
    the actor does not run them (``vlm_supported``: the 0.9 engine, also under Ulysses) (LoRA runs; its one refusal,
    adapter dropout, needs the built model: ``lora_unsupported``.)"""
    if ulysses_sp > 1 and not ulysses_supported:
        return ("Ulysses sequence parallel > 1 in the verl 0.7 legacy actor (set ulysses_sequence_parallel_size=1, "
                "or use verl 0.9's engine, where zorro runs under Ulysses)")
    if hf_config is not None and getattr(hf_config, "vision_config", None) is not None:
        if not vlm_supported:
            return ("vision-language models in this actor (3-D position ids / multimodal inputs: it does not hand "
                    "images and 3-D positions to zorro's packed forward; zorro runs VLMs in verl 0.9's engine)")
    return None


#: How a verl user switches zorro off or to ``warn`` (the tail of :func:`report_unsupported`'s message).
VERL_FIX_HINT = ("disable zorro (fsdp_config.zorro.enable=false), or set fsdp_config.zorro.on_unsupported=warn to "
                 "run the stock forward for such batches")


def report_unsupported(settings: "ZorroSettings", reason: str, warned: set, log: logging.Logger,
                       fix_hint: str = VERL_FIX_HINT) -> None:
    """A setting zorro cannot run exactly: raise (``on_unsupported=raise``) or warn once per reason (``warn``; the
    caller then runs the stock forward and counts the batch in ``zorro/fallback_batches``). ``fix_hint`` says how
    this framework's user disables zorro or switches to ``warn``."""
    msg = (f"zorro: unsupported setting: {reason}. Fix the setting, {fix_hint} (counted in "
           "zorro/fallback_batches).")
    if settings.on_unsupported == "raise":
        raise ValueError(msg)
    if reason not in warned:
        warned.add(reason)
        log.warning(msg)

class ZorroActorMixin:
    """The zorro state both verl actors share (0.9 engine, 0.7 legacy actor): the settings, the static support
    check (``_zorro_static_unsupported``, defined by each actor), warn-once bookkeeping and the chosen backend."""

    #: Rows per chunk of the ``compute`` / ``memory`` logits modes (an attribute so tests can make it small).
    logits_chunk_size = DEFAULT_CHUNK
    #: The framework's way to disable zorro or switch to ``warn``, quoted in refusals.
    zorro_fix_hint = VERL_FIX_HINT

    def _zorro_setup(self, settings: "ZorroSettings", device_type: str) -> None:
        self.zorro = settings
        self._zorro_warned: set = set()
        self._zorro_static_reason: Optional[str] = None
        self._zorro_backend: Optional[str] = None
        if not settings.enable:
            return
        self._zorro_static_reason = self._zorro_static_unsupported()
        if self._zorro_static_reason is not None:
            self._zorro_unsupported(self._zorro_static_reason)
        else:
            self._zorro_backend = settings.resolved_backend(device_type)

    @property
    def zorro_active(self) -> bool:
        return self.zorro.enable and self._zorro_static_reason is None

    def _zorro_unsupported(self, reason: str) -> None:
        report_unsupported(self.zorro, reason, self._zorro_warned, logging.getLogger(type(self).__module__),
                           self.zorro_fix_hint)
