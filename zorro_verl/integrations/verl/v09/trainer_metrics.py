"""zorro metrics of every engine pass in the step's metrics of verl's V1 trainer (docs/design/verl.md).

The engine reports ``zorro/*`` metrics with every call (:mod:`.engine`). verl's V1 trainer
(``verl.trainer.ppo.v1.trainer_base.PPOTrainer``) logs those of the actor update (as ``actor/zorro/...``) but drops
everything that ``compute_log_prob`` / ``compute_ref_log_prob`` return. :func:`install_v1_hook` wraps the trainer's
``_compute_old_log_prob`` / ``_compute_ref_log_prob`` so that, for the duration of the call, the worker group's
method hands its output to zorro as well; the pass's ``zorro/<key>`` values reach the step's metrics as
``zorro/old_log_prob/<key>`` and ``zorro/ref/<key>``. The same for the critic's ``_compute_values`` (its worker
call returns one future per rank, which the trainer waits on and drops; the wrapper reads their outputs):
``zorro/values/<key>``.
``_update_critic``'s metrics reach the step as ``critic/zorro/<key>`` already (verl logs them).

Effective MFU: verl's MFU counts the FLOPs of the ordinary batch (every prompt once per rollout), which overstates
the work a deduplicated pass does. ``zorro/effective_mfu/<pass>`` is verl's MFU scaled by the fraction of tokens
actually computed, ``computed / (computed + prompt_tokens_saved)`` (a token-proportional estimate: exact for the
linear layers, which dominate; attention FLOPs shrink somewhat more). ``<pass>``: ``actor`` (from
``perf/mfu/actor``), ``critic`` (from ``perf/mfu/critic``), ``old_log_prob``, ``ref`` and ``values`` (from the
pass's own ``mfu``, which verl computes and drops).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from numbers import Number
from typing import Any

from zorro_verl.integrations.verl.v09.markers import mark_balanced

__all__ = ["install_v1_hook", "pass_metrics", "output_metrics", "effective_mfu"]

logger = logging.getLogger(__name__)

#: trainer method -> (metric prefix, worker-group methods whose output carries the pass's metrics)
_PASSES = {
    "_compute_old_log_prob": ("old_log_prob", (("actor_rollout_wg", "compute_log_prob"),)),
    "_compute_ref_log_prob": ("ref", (("ref_policy_wg", "compute_ref_log_prob"), ("actor_rollout_wg",
                                                                                   "compute_log_prob"))),
    "_compute_values": ("values", (("critic_wg", "infer_batch"),)),
}


def _numbers(v: Any) -> list[float]:
    """Flatten a metric value (number, tensor, verl ``Metric``, nested lists of these) to floats."""
    if isinstance(v, bool):
        return [float(v)]
    if isinstance(v, Number):
        return [float(v)]
    if hasattr(v, "aggregate"):  # verl.utils.metric.Metric
        return _numbers(v.aggregate())
    if hasattr(v, "tolist"):  # tensors, numpy arrays and scalars
        return _numbers(v.tolist())
    if isinstance(v, (list, tuple)):
        return [x for item in v for x in _numbers(item)]
    return []


def _reduce(key: str, vals: list[float]) -> float:
    """verl's ``reduce_metrics`` rule: max for keys naming max, min for min, else the mean."""
    if "max" in key:
        return max(vals)
    if "min" in key:
        return min(vals)
    return sum(vals) / len(vals)


def output_metrics(output: Any) -> dict:
    """The ``metrics`` a worker call returned: ``KVBatchMeta.extra_info`` (transfer-queue mode), a ``TensorDict``'s
    non-tensor ``metrics`` or a ``DataProto``'s ``meta_info``; ``{}`` when there are none."""
    if output is None:
        return {}
    extra = getattr(output, "extra_info", None)
    if isinstance(extra, dict) and isinstance(extra.get("metrics"), dict):
        return extra["metrics"]
    meta = getattr(output, "meta_info", None)
    if isinstance(meta, dict) and isinstance(meta.get("metrics"), dict):
        return meta["metrics"]
    from verl.utils import tensordict_utils as tu

    if isinstance(output, tu.TensorDict) and "metrics" in output.keys():
        m = tu.get(output, "metrics")
        return m if isinstance(m, dict) else {}
    return {}


def effective_mfu(mfu: float, computed_tokens: float, prompt_tokens_saved: float) -> float:
    """``mfu`` scaled by the computed fraction of the ordinary tokens, ``computed / (computed + saved)``."""
    ordinary = computed_tokens + prompt_tokens_saved
    return mfu * computed_tokens / ordinary if ordinary > 0 else mfu


def pass_metrics(metrics: dict, name: str) -> dict:
    """``zorro/<key>`` of one pass's worker metrics -> ``zorro/<name>/<key>`` (reduced like verl does), plus
    ``zorro/effective_mfu/<name>`` when the pass reported ``mfu`` and zorro's token counts."""
    out: dict[str, float] = {}
    for k, v in metrics.items():
        if isinstance(k, str) and k.startswith("zorro/"):
            vals = _numbers(v)
            if vals:
                out[f"zorro/{name}/{k[len('zorro/'):]}"] = _reduce(k, vals)
    mfu = _numbers(metrics.get("mfu"))
    computed = out.get(f"zorro/{name}/computed_tokens")
    saved = out.get(f"zorro/{name}/prompt_tokens_saved")
    if mfu and computed is not None and saved is not None:
        out[f"zorro/effective_mfu/{name}"] = effective_mfu(sum(mfu) / len(mfu), computed, saved)
    return out


@contextlib.contextmanager
def _capture(trainer, targets, sink: list):
    """While active, the worker-group methods ``targets`` (``(attribute of trainer, method)``) append their output
    to ``sink``; restored afterwards."""
    restore = []
    try:
        for wg_attr, method in targets:
            wg = getattr(trainer, wg_attr, None)
            orig = getattr(wg, method, None) if wg is not None else None
            if orig is None or getattr(orig, "_zorro_capture", False):
                continue

            def call(*args, _orig=orig, **kwargs):
                out = _orig(*args, **kwargs)
                sink.append(out)
                return out

            call._zorro_capture = True
            had = method in vars(wg)
            setattr(wg, method, call)
            restore.append((wg, method, orig, had))
        yield
    finally:
        for wg, method, orig, had in reversed(restore):
            if had:
                setattr(wg, method, orig)
            else:
                delattr(wg, method)


def _restamp(batch) -> None:
    """Put the balance hook's stamp (markers.py) back on a V1 batch before a worker pass: verl replaces a
    ``KVBatchMeta``'s ``extra_info`` by each worker call's output meta data, so the stamp the balance hook left is
    gone after the first pass. (These wrappers are installed with the balance hook, :func:`.registration.install`:
    a trainer that has them has the hook.)"""
    info = getattr(batch, "extra_info", None)
    if isinstance(info, dict):
        mark_balanced(info)


def _merged_metrics(out) -> dict:
    """The metrics of one worker-group call's output. A non-blocking call (``DataProtoFuture``: the critic's
    ``infer_batch``) holds one future per rank, which the trainer has already waited on; their outputs (the
    transfer-queue metadata of each rank's result, or None on ranks without outputs) are read one by one and each
    key's values concatenated (``DataProtoFuture.get`` cannot collect transfer-queue metadata)."""
    futures = getattr(out, "futures", None)
    if futures is None:
        return output_metrics(out)
    import ray

    merged: dict = {}
    for rank_out in ray.get(list(futures)):
        for k, v in output_metrics(rank_out).items():
            merged.setdefault(k, []).extend(_numbers(v))
    return merged


def _wrap_pass(cls, attr: str, name: str, targets) -> None:
    orig = getattr(cls, attr)
    if getattr(orig, "_zorro_metrics_hook", False):
        return

    @functools.wraps(orig)
    def wrapped(self, batch, metrics, *args, **kwargs):
        _restamp(batch)
        outputs: list = []
        with _capture(self, targets, outputs):
            result = orig(self, batch, metrics, *args, **kwargs)
        for out in outputs:
            metrics.update(pass_metrics(_merged_metrics(out), name))
        return result

    wrapped._zorro_metrics_hook = True
    setattr(cls, attr, wrapped)


def _wrap_update(cls, role: str) -> None:
    """Wrap ``_update_<role>`` (``actor``, ``critic``): stamp the batch first, add ``zorro/effective_mfu/<role>``."""
    attr = f"_update_{role}"
    orig = getattr(cls, attr, None)
    if orig is None or getattr(orig, "_zorro_metrics_hook", False):
        return

    @functools.wraps(orig)
    def update(self, batch, metrics, *args, **kwargs):
        _restamp(batch)
        result = orig(self, batch, metrics, *args, **kwargs)
        mfu, computed = metrics.get(f"perf/mfu/{role}"), metrics.get(f"{role}/zorro/computed_tokens")
        saved = metrics.get(f"{role}/zorro/prompt_tokens_saved")
        if mfu is not None and computed is not None and saved is not None:
            metrics[f"zorro/effective_mfu/{role}"] = effective_mfu(float(mfu), float(computed), float(saved))
        return result

    update._zorro_metrics_hook = True
    setattr(cls, attr, update)


def install_v1_hook(module) -> None:
    """Post-import hook of ``verl.trainer.ppo.v1.trainer_base``: route the forward-only passes' zorro metrics
    (old log-probs, reference, the critic's values), stamp the batch before every pass and update, and add the
    effective MFU (idempotent)."""
    cls = module.PPOTrainer
    for attr, (name, targets) in _PASSES.items():
        _wrap_pass(cls, attr, name, targets)
    _wrap_update(cls, "actor")
    _wrap_update(cls, "critic")
