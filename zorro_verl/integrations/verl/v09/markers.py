"""What zorro's trainer hooks leave on a batch for the engine to see (docs/design/verl.md). Imports no verl.

The trainer's ``_balance_batch`` hook (:mod:`.balance`) runs in the trainer process, the engine in the workers; the
engine cannot tell from its own process whether the trainer installed the hook (an overrides-only launch with
``VERL_USE_EXTERNAL_PLUGINS`` excluding zorro's entry point never imports the plugin there). So the hook stamps the
batch's meta data, which verl hands to every worker method as non-tensor data of the batch (the V1 trainer:
``KVBatchMeta.extra_info``; ``RayPPOTrainer``: ``DataProto.meta_info``), and the engine checks the stamp.
"""

from __future__ import annotations

from typing import Any, MutableMapping

__all__ = ["BALANCE_MARKER_KEY", "mark_balanced"]

#: Key of the stamp in the batch's meta data (``extra_info`` / ``meta_info``; the engine's non-tensor data).
BALANCE_MARKER_KEY = "zorro_balance_hook"


def mark_balanced(meta: MutableMapping[str, Any]) -> None:
    """Stamp a batch's meta data (``KVBatchMeta.extra_info`` or ``DataProto.meta_info``): zorro's trainer balance hook
    ran on this batch. Called on every path of the hook (zorro's balancing, verl's own when zorro or
    ``group_balance`` is off, the fallback after an error), so a missing stamp means the hook is not installed."""
    if not isinstance(meta, MutableMapping):
        raise TypeError(f"mark_balanced: expected the batch's meta data dict (KVBatchMeta.extra_info or "
                        f"DataProto.meta_info), got {type(meta).__name__}.")
    meta[BALANCE_MARKER_KEY] = True

