"""Which of verl 0.9's loss settings give the stock engine's numbers under zorro's micro-batching (docs/design/verl.md
"verl facts: loss normalisation").

The zorro engine regroups a mini-batch's rows into group-aware micro-batches, so a row shares its micro-batch with
other rows than under the stock engine. verl's ``ppo_loss`` runs once per micro-batch; a loss term is unchanged by
the regrouping exactly when it is a sum of per-row terms normalised by global quantities (``batch_num_tokens``,
``global_batch_size``, ``dp_size``, ``loss_scale_factor``, all the same for every micro-batch of the step):

* ``loss_agg_mode`` ``token-mean``, ``token-sum``, ``seq-mean-token-mean``, ``seq-mean-token-sum``: equal;
* ``seq-mean-token-sum-norm`` with ``loss_scale_factor`` set: equal (a constant horizon). **Unset**, the horizon is
  the padded width of the micro-batch's ``response_mask``: with a padded ``[B, R]`` mask (``RayPPOTrainer``'s
  layout) that is ``R`` for every micro-batch -> equal; with a nested mask (the V1 trainer's layout) it is the
  micro-batch's longest response, which regrouping changes and which zorro cannot reproduce per row from one loss
  call per micro-batch -> refused for that batch;
* ``policy_loss.loss_mode`` ``clip_cov`` / ``kl_cov``: tokens picked from the micro-batch's covariance statistics
  (mean over the micro-batch, a count proportional to its tokens) -> refused; ``geo_mean``: ``torch.mean`` over the
  micro-batch's rows -> refused; ``bypass_mode`` with ``rollout_correction.rollout_is_batch_normalize``: IS weights
  normalised per micro-batch -> refused;
* every policy loss is checked against an **allow-list**, :data:`VERIFIED_POLICY_LOSSES`: verl's registered losses
  that aggregate through ``agg_loss`` and that ``tests/integrations/verl/v09/test_loss_modes.py`` measures equal to
  the stock engine. Any other name (a loss registered with verl's ``register_policy_loss``) and a verified name whose
  registered function is not verl's own (re-registered) are refused: zorro cannot know whether they depend on which
  rows share a micro-batch.

The loss settings are not part of the engine config: the worker hands the engine ``functools.partial(ppo_loss,
config=actor_config)`` (or ``distillation_ppo_loss``, or a critic's ``value_loss``) with each batch, so the check
reads the config bound to that partial, per batch. Imports no verl.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Optional

__all__ = ["loss_unsupported", "bound_loss_config", "VERIFIED_POLICY_LOSSES"]

#: policy_loss.loss_mode values zorro has verified to give the stock engine's loss and gradients under its regrouping
#: (tests/integrations/verl/v09/test_loss_modes.py); ``bypass_mode`` without ``rollout_is_batch_normalize``.
VERIFIED_POLICY_LOSSES = ("vanilla", "gspo", "sapo", "gpg", "cispo", "dppo_tv", "dppo_kl", "dro", "bypass_mode")
#: Where verl defines its own policy losses (a verified name registered from elsewhere is not verl's function).
_VERL_LOSSES_MODULE = "verl.trainer.ppo.core_algos"

#: policy_loss.loss_mode values whose loss depends on which rows share a micro-batch (see the module doc).
_PER_MICRO_BATCH_MODES = {
    "clip_cov": "picks the tokens it clips from the micro-batch's covariance statistics",
    "kl_cov": "picks the tokens it penalises from the micro-batch's covariance statistics",
    "geo_mean": "averages the sequence losses over the micro-batch's rows (torch.mean)",
}


def _get(cfg: Any, key: str, default=None):
    if cfg is None:
        return default
    if isinstance(cfg, dict):
        return cfg.get(key, default)
    if hasattr(cfg, "get"):  # verl's BaseConfig and OmegaConf nodes
        try:
            return cfg.get(key, default)
        except Exception:  # noqa: BLE001 - a struct node without the key
            pass
    return getattr(cfg, key, default)


def bound_loss_config(loss_function) -> tuple[Any, Any]:
    """``(config, distillation_config)`` bound to verl's loss partial (keyword ``config=`` as verl's worker binds
    it, or the first positional argument); ``(None, None)`` for a loss function without a bound config."""
    fn, config, distill = loss_function, None, None
    while isinstance(fn, functools.partial):
        if config is None:
            config = fn.keywords.get("config", fn.args[0] if fn.args else None)
        if distill is None:
            distill = fn.keywords.get("distillation_config")
        fn = fn.func
    return config, distill


def _registered_elsewhere(loss_mode: str) -> Optional[str]:
    """``module.name`` of the function verl's policy-loss registry holds for ``loss_mode`` when it is not verl's own
    (None when it is, or when verl's registry is not loaded in this process: then the worker has not built it)."""
    core = sys.modules.get(_VERL_LOSSES_MODULE)
    fn = getattr(core, "POLICY_LOSS_REGISTRY", {}).get(loss_mode) if core is not None else None
    module = getattr(fn, "__module__", _VERL_LOSSES_MODULE)
    return None if fn is None or module == _VERL_LOSSES_MODULE else f"{module}.{getattr(fn, '__qualname__', fn)}"


def _policy_mode_unsupported(loss_mode: Optional[str], policy_loss: Any, where: str) -> Optional[str]:
    if loss_mode in _PER_MICRO_BATCH_MODES:
        return (f"{where}={loss_mode} {_PER_MICRO_BATCH_MODES[loss_mode]}, so its loss depends on which rows share "
                "a micro-batch and zorro regroups rows by prompt (use another policy loss mode, e.g. vanilla)")
    verified = ", ".join(VERIFIED_POLICY_LOSSES)
    if loss_mode not in VERIFIED_POLICY_LOSSES:
        return (f"{where}={loss_mode!r} is not a policy loss zorro has verified (verified: {verified}); zorro "
                "regroups rows by prompt across micro-batches and cannot know whether this loss depends on which "
                "rows share one (use a verified loss mode, or run this loss with the stock engine: "
                "fsdp_config.zorro.enable=false)")
    elsewhere = _registered_elsewhere(loss_mode)
    if elsewhere is not None:
        return (f"{where}={loss_mode!r} is registered in verl's policy-loss registry as {elsewhere}, not verl's own "
                f"function that zorro verified (verified: verl's {verified}); zorro regroups rows by prompt across "
                "micro-batches and cannot know whether this loss depends on which rows share one (register it under "
                "another name and run it with the stock engine: fsdp_config.zorro.enable=false)")
    if loss_mode == "bypass_mode":
        rc = _get(policy_loss, "rollout_correction")
        if _get(rc, "rollout_is_batch_normalize", False):
            return (f"{where}=bypass_mode with rollout_correction.rollout_is_batch_normalize=true normalises the IS "
                    "weights per micro-batch, so its loss depends on which rows share a micro-batch and zorro "
                    "regroups rows by prompt (set rollout_is_batch_normalize=false)")
    return None


def _horizon_is_per_micro_batch(data) -> bool:
    """verl's default horizon is ``response_mask.to_padded_tensor().shape[-1]``: per micro-batch when the mask is
    nested (or unknown), the batch's fixed width ``R`` when it is a padded ``[B, R]`` tensor."""
    if data is None or "response_mask" not in data.keys():
        return True
    return bool(getattr(data["response_mask"], "is_nested", False))


def loss_unsupported(loss_function, data=None) -> Optional[str]:
    """Why verl's ``loss_function`` on the batch ``data`` (a verl TensorDict; None = not known) would give other
    numbers than the stock engine under zorro's regrouping (the reason names the setting and the fix), or None. A
    loss function without a bound config is not inspected."""
    config, distill = bound_loss_config(loss_function)
    if config is None:
        return None
    if (_get(config, "loss_agg_mode") == "seq-mean-token-sum-norm" and _get(config, "loss_scale_factor") is None
            and _horizon_is_per_micro_batch(data)):
        return ("loss_agg_mode=seq-mean-token-sum-norm with loss_scale_factor unset divides each micro-batch's loss "
                "by its own longest response (the response_mask is nested), so the loss depends on which rows "
                "share a micro-batch and zorro regroups rows by prompt (set actor_rollout_ref.actor."
                "loss_scale_factor, e.g. to data.max_response_length, or use loss_agg_mode=token-mean)")
    policy_loss = _get(config, "policy_loss")
    reason = _policy_mode_unsupported(_get(policy_loss, "loss_mode", "vanilla"), policy_loss,
                                      "actor.policy_loss.loss_mode")
    if reason is None and distill is not None:
        dl = _get(distill, "distillation_loss")
        if _get(dl, "use_policy_gradient", False):
            reason = _policy_mode_unsupported(_get(dl, "policy_loss_mode", "vanilla"), _get(dl, "policy_loss"),
                                              "distillation.distillation_loss.policy_loss_mode")
    return reason
