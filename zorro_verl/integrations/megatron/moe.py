"""MoE router statistics on zorro's packed row, counted as the ordinary forward counts them (docs/design/megatron.md,
MoE).

Routing is token-wise: a prompt token computed once is routed as each of its copies would be. What changes is every
statistic megatron's ``TopKRouter`` reduces over the micro-batch's tokens. In the ordinary forward a prompt shared by
``n`` rows contributes ``n`` tokens; on the packed row it is one token. So each packed token carries its
**multiplicity** ``w [Tp] int64``: the number of ordinary tokens it stands for (the rows of its group for a prompt
token, the rows under the trie node for a ``sharing="prefix"`` plan, 1 for a response token, 0 for the
sequence-parallel pad tokens), taken from ``plan.full_index()`` once per micro-batch (no host sync). With it:

* load-balancing ``aux_loss`` / ``global_aux_loss``: tokens per expert ``sum_t w_t routing_map_t`` (the same
  all-reduce as megatron's), router scores ``sum_t w_t scores_t``, token count ``sum_t w_t`` (=
  ``plan.ordinary_tokens``, a Python int); the loss reaches the gradient through megatron's own
  ``MoEAuxLossAutoScaler`` and is logged by the router's own ``attach_and_log_load_balancing_loss``;
* ``z_loss``: ``coeff * sum_t w_t lse_t^2 / sum_t w_t`` over the TP group (each sequence-parallel rank's part
  divided by the whole micro-batch's count; megatron's equal shards make its per-rank means the same sum);
* expert bias: ``local_tokens_per_expert += sum_t w_t routing_map_t`` (megatron's ``finalize_model_grads`` then
  all-reduces it and updates the bias as usual).

Refused (ValueError naming the setting, decided on the built routers as megatron decides): ``seq_aux_loss`` (a loss
per ordinary sequence, whose sequences are the micro-batch's layout: bshd rows with their padding, or verl's whole
THD micro-batch as one sequence), capacity factors / token dropping (which tokens are dropped depends on the batch's
token order and count), sinkhorn and quantile balancing (routing itself normalised over the batch's tokens), input
jitter and forced / biased random routing (random draws of the batch's shape), routing replay (routes recorded per
ordinary token), routers of unknown classes, and activation recomputation that covers the router while a statistic
is on (megatron computes them again in backward, outside the zorro forward).

The weighting is a set of instance attributes over ``TopKRouter`` methods (:class:`TokenWeightedRouters`), present
only during a zorro forward; megatron's own methods run otherwise.
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, switch_load_balancing_loss_func
from megatron.core.transformer.moe.router import TopKRouter

from zorro_verl.packing import ZorroPlan

__all__ = ["moe_routers", "router_statistics", "check_moe_statistics", "token_multiplicity",
           "TokenWeightedRouters", "WEIGHTED_STATISTICS"]

#: the router statistics zorro counts by multiplicity (everything else over the batch's tokens is refused)
WEIGHTED_STATISTICS = ("aux_loss", "global_aux_loss", "z_loss", "expert_bias")
#: the methods of megatron-core's TopKRouter (0.19) the weighting replaces for a zorro forward
_METHODS = ("_apply_aux_loss", "_apply_seq_aux_loss", "_apply_global_aux_loss", "apply_z_loss", "_apply_expert_bias")


def moe_routers(model: torch.nn.Module) -> list:
    """The routers of this stage's MoE layers (``MoELayer.router``), in module order."""
    return [m.router for m in model.modules() if isinstance(m, MoELayer)]


def router_statistics(router) -> set:
    """What a built router computes over the micro-batch's tokens in training, as megatron decides it:
    ``aux_loss`` / ``seq_aux_loss`` / ``global_aux_loss`` iff ``router.get_aux_loss_coeff(type) > 0`` (so
    ``moe_router_load_balancing_type='none'`` has none whatever ``moe_aux_loss_coeff`` says), ``z_loss`` iff
    ``moe_z_loss_coeff`` is set, ``expert_bias`` iff the router has expert bias and a nonzero update rate,
    ``token_dropping`` iff a capacity factor is set."""
    cfg = router.config
    out = set()
    if isinstance(router, TopKRouter):
        out |= {t for t in ("aux_loss", "seq_aux_loss", "global_aux_loss") if router.get_aux_loss_coeff(t) > 0}
        if getattr(router, "enable_expert_bias", False) and cfg.moe_router_bias_update_rate:
            out.add("expert_bias")
    if cfg.moe_z_loss_coeff is not None:
        out.add("z_loss")
    if cfg.moe_expert_capacity_factor is not None or getattr(cfg, "moe_token_dropping", False):
        out.add("token_dropping")
    return out


def _refuse(name: str, got, expected: str, why: str, fix: Optional[str] = None) -> None:
    raise ValueError(f"{name}: got {got!r} on an MoE model; with zorro it must be {expected}: {why}. "
                     f"{fix or f'Set {name}={expected}'}.")


def check_moe_statistics(model: torch.nn.Module) -> set:
    """``ValueError`` naming the setting when a router of ``model`` (this stage) computes something over the
    micro-batch's tokens that zorro cannot count by multiplicity; returns the weighted statistics in use (a subset of
    :data:`WEIGHTED_STATISTICS`, empty: nothing to weight)."""
    routers = moe_routers(model)
    if not routers:
        return set()
    cfg = routers[0].config
    if getattr(cfg, "moe_enable_routing_replay", False):
        _refuse("moe_enable_routing_replay", True, "False", "routes are recorded and replayed per token of the "
                "ordinary rows")
    if getattr(cfg, "moe_router_force_load_balancing", False):
        _refuse("moe_router_force_load_balancing", True, "False", "random logits are drawn in the micro-batch's "
                "token shape")
    if getattr(cfg, "moe_router_force_biased", None) is not None:
        _refuse("moe_router_force_biased", cfg.moe_router_force_biased, "None", "a random bias is drawn in the "
                "micro-batch's token shape")
    if getattr(cfg, "moe_input_jitter_eps", None) is not None:
        _refuse("moe_input_jitter_eps", cfg.moe_input_jitter_eps, "None", "the jitter noise is drawn in the "
                "micro-batch's token shape")
    types = cfg.moe_router_load_balancing_type
    for t in (types if isinstance(types, list) else [types]):
        if t in ("sinkhorn", "quantile_balancing"):
            _refuse("moe_router_load_balancing_type", types, "'none' or 'aux_loss'",
                    f"{t} routing normalises the routes over the micro-batch's tokens",
                    "Use 'none' or 'aux_loss' (counted exactly)")
    used = set()
    for router in routers:
        stats = router_statistics(router)
        if "seq_aux_loss" in stats:
            _refuse("moe_router_load_balancing_type", types, "'aux_loss' or 'none' (not 'seq_aux_loss')",
                    "the sequence-level loss is per ordinary sequence, and which tokens form a sequence is the "
                    "micro-batch's layout (a padded bshd row, or verl's whole THD micro-batch)",
                    "Use 'aux_loss' (counted exactly) or 'none'")
        if "token_dropping" in stats:
            what = ("moe_expert_capacity_factor", cfg.moe_expert_capacity_factor, "None") \
                if cfg.moe_expert_capacity_factor is not None else ("moe_token_dropping", True, "False")
            _refuse(*what, "the tokens an expert drops depend on the micro-batch's token count and order")
        if stats and not all(callable(getattr(type(router), m, None)) for m in _METHODS):
            raise ValueError(f"MoE router: {type(router).__name__} computes {sorted(stats)} over the micro-batch's "
                             "tokens, and zorro counts them only on megatron-core's TopKRouter. Turn them off "
                             "(moe_router_load_balancing_type='none', moe_z_loss_coeff=None, "
                             "moe_router_enable_expert_bias=False).")
        used |= stats
    if used and (cfg.recompute_granularity == "full" or (cfg.recompute_granularity == "selective"
                                                         and "moe" in (cfg.recompute_modules or []))):
        _refuse("recompute_granularity", cfg.recompute_granularity, "None, or 'selective' without 'moe' in "
                "recompute_modules", f"the router's {sorted(used)} are computed again in the backward recomputation, "
                "outside the zorro forward that counts them by multiplicity",
                "Recompute selectively without 'moe' (e.g. recompute_modules=['core_attn']), or turn those "
                "statistics off")
    return used


def token_multiplicity(plan: ZorroPlan) -> torch.Tensor:
    """``[T] int64``: how many tokens of the ordinary per-row forward each packed token stands for (a prompt
    token: its group's rows; a prefix-tree token: the rows under its node; a response token: 1). Memoised on the
    plan; no host sync."""

    def build():
        idx = plan.full_index().reshape(-1)  # [B * S], -1 on pads
        idx = torch.where(idx >= 0, idx, plan.T)  # pads into one spare slot
        w = torch.zeros(plan.T + 1, dtype=torch.long, device=plan.device)
        return w.index_add_(0, idx, torch.ones_like(idx))[:plan.T]

    return plan.memo.get("token_multiplicity", build)


class TokenWeightedRouters:
    """For one zorro forward: each router's token statistics counted by multiplicity. ``w [Tp] int64`` (padded to
    the model's row length, 0 on pad tokens) is this micro-batch's :func:`token_multiplicity`; under sequence
    parallelism each TP rank takes its shard of it (the rows its router sees). ``total`` is ``sum w``: the ordinary
    forward's token count. Instance attributes over the routers' methods, removed on exit."""

    def __init__(self, routers: list, w: torch.Tensor, total: int, sequence_parallel: bool):
        self.routers, self.w, self.total, self.sp = routers, w, total, sequence_parallel

    def __enter__(self):
        for router in self.routers:
            if any(m in vars(router) for m in _METHODS):
                raise ValueError("MoE router: its methods are already replaced on this instance (a zorro step inside "
                                 "another?); run one zorro step at a time.")
        for router in self.routers:
            w = self.w
            if self.sp:  # the router sees this rank's contiguous sequence shard
                tp = router.tp_group.size()
                w = w.view(tp, -1)[router.tp_group.rank()]
            for name, method in _bind(router, w, self.total).items():
                setattr(router, name, method)
        return self

    def __exit__(self, *exc):
        for router in self.routers:
            for name in _METHODS:
                vars(router).pop(name, None)
        return False


def _bind(router, w: torch.Tensor, total: int) -> dict:
    """The weighted versions of megatron-core 0.19's ``TopKRouter`` statistics for one router, ``w [n] int64`` the
    multiplicities of the tokens it routes (``n`` = its input's ``seq * batch``), ``total`` the ordinary tokens of
    the whole micro-batch (all TP ranks)."""
    cfg = router.config
    tp = router.tp_cp_group.size()
    # megatron's per-rank token count in the ordinary forward: its equal sequence shards
    local_count = total / tp

    def check(n: int) -> None:
        if n != w.numel():
            raise ValueError(f"MoE router: expected {w.numel()} tokens (the zorro row's shard), got {n}; the router "
                             "does not see the packed row zorro planned.")

    def weighted_loss(scores: torch.Tensor, routing_map: torch.Tensor, group, tokens_per_expert=None):
        check(routing_map.shape[0])
        if tokens_per_expert is None:
            tokens_per_expert = reduce_from_tensor_model_parallel_region((routing_map.long() * w[:, None]).sum(0),
                                                                         group)
        return tokens_per_expert, scores * w.to(scores.dtype)[:, None]

    def _apply_aux_loss(probs, scores_for_aux_loss, routing_map, with_padding_mask=False):
        coeff = router.get_aux_loss_coeff("aux_loss")
        if coeff == 0:
            return probs
        tpe, scores = weighted_loss(scores_for_aux_loss, routing_map, router.tp_cp_group)
        aux = switch_load_balancing_loss_func(probs=scores, tokens_per_expert=tpe, total_num_tokens=total,
                                              topk=router.topk, num_experts=cfg.num_moe_experts,
                                              moe_aux_loss_coeff=coeff, fused=cfg.moe_router_fusion)
        return router.attach_and_log_load_balancing_loss(probs, coeff, aux, "load_balancing_loss",
                                                         router.tp_cp_group, valid_token_count=local_count)

    def _apply_seq_aux_loss(probs, scores_for_aux_loss, routing_map, seq_length, bsz, with_padding_mask=False):
        if router.get_aux_loss_coeff("seq_aux_loss") == 0:
            return probs
        raise ValueError("moe_router_load_balancing_type: 'seq_aux_loss' is not counted by zorro (checked before "
                         "the forward; the model's config changed since?).")

    def _apply_global_aux_loss(probs, scores_for_aux_loss, routing_map, with_padding_mask=False):
        coeff = router.get_aux_loss_coeff("global_aux_loss")
        if coeff == 0:
            return probs
        group = router.tp_dp_cp_group
        tpe, scores = weighted_loss(scores_for_aux_loss, routing_map, group)
        router.global_tokens_per_expert += tpe
        router.ga_steps += 1
        aux = switch_load_balancing_loss_func(probs=scores,
                                              tokens_per_expert=router.global_tokens_per_expert / router.ga_steps,
                                              total_num_tokens=local_count * group.size(), topk=router.topk,
                                              num_experts=cfg.num_moe_experts, moe_aux_loss_coeff=coeff,
                                              fused=cfg.moe_router_fusion)
        return router.attach_and_log_load_balancing_loss(probs, coeff, aux, "global_load_balancing_loss", group,
                                                         needs_dp_avg=False, valid_token_count=local_count)

    def apply_z_loss(logits, padding_mask: Optional[torch.Tensor] = None):
        if cfg.moe_z_loss_coeff is None or not (router.training and torch.is_grad_enabled()):
            return logits
        check(logits.shape[0])
        coeff = cfg.moe_z_loss_coeff / tp  # megatron's: each TP rank's part, summed over the group
        z = torch.square(torch.logsumexp(logits, dim=-1))
        z_loss = (z * w.to(z.dtype)).sum() / local_count * coeff
        scale = local_count * tp if router.calculate_per_token_loss else None
        logits = MoEAuxLossAutoScaler.apply(logits, z_loss if scale is None else z_loss * scale)
        get_moe_metrics_tracker().record("z_loss", z_loss / coeff, router.layer_number, cfg.num_layers,
                                         avg_group=router.tp_dp_cp_group)
        return logits

    def _apply_expert_bias(routing_map, padding_mask: Optional[torch.Tensor] = None):
        if router.enable_expert_bias and torch.is_grad_enabled():
            check(routing_map.shape[0])
            with torch.no_grad():
                router.local_tokens_per_expert += (routing_map.long() * w[:, None]).sum(0)

    return {"_apply_aux_loss": _apply_aux_loss, "_apply_seq_aux_loss": _apply_seq_aux_loss,
            "_apply_global_aux_loss": _apply_global_aux_loss, "apply_z_loss": apply_z_loss,
            "_apply_expert_bias": _apply_expert_bias}
