"""Group-aware DP balancing for the verl >= 0.9 trainers' ``_balance_batch`` (docs/DESIGN.md §6).

verl's balancing spreads a prompt's rollouts over DP ranks by sequence length, so each rank sees most prompts once
per group member and deduplication saves almost nothing on multi-GPU runs. With zorro enabled and
``zorro.group_balance: true`` (the default) the trainer instead bin-packs whole groups onto ranks by deduplicated
token cost (:func:`~zorro_verl.packing.microbatch.balance_groups_across_ranks`); ranks still get equal row counts
(verl dispatches equal chunks), so a group is split only when it cannot fit (counted in
``zorro/balance_split_groups``). With zorro disabled or the key false, verl's own balancing runs unchanged.
"""

from __future__ import annotations

import functools
import logging

import torch

from zorro_verl.integrations.verl.settings import ZorroSettings
from zorro_verl.packing import group_ids
from zorro_verl.packing.microbatch import DPBalance, balance_groups_across_ranks

__all__ = ["group_balance", "install_v0_hook", "install_v1_hook", "trainer_zorro_settings", "v1_group_of_key"]

logger = logging.getLogger(__name__)


def group_balance(prompts: torch.Tensor, attention_mask: torch.Tensor, dp_size: int) -> DPBalance:
    """Place whole groups on ranks.

    Args:
        prompts: ``[B, Pw]`` left-padded prompt ids; attention_mask: ``[B, Pw + R]`` (0 on both pads).
        dp_size: data-parallel ranks.

    Returns:
        :class:`DPBalance`; ``permutation()`` is the reorder index for ``batch.reorder``.
    """
    pw = prompts.shape[1]
    pm = attention_mask[:, :pw] != 0
    g = group_ids(prompts, pm)
    p = pm.sum(1)
    r = (attention_mask[:, pw:] != 0).sum(1)
    return balance_groups_across_ranks(g, p, r, dp_size, equal_size=True)


def trainer_zorro_settings(config) -> ZorroSettings:
    """The actor's zorro settings from the trainer config (disabled when the node has no ``zorro`` key)."""
    node = config.actor_rollout_ref.actor.get("fsdp_config", {}) or {}
    return ZorroSettings.from_mapping(node.get("zorro", {}) or {})


def _unsupported_keep_minibatch(settings: ZorroSettings, metrics: dict) -> None:
    msg = ("zorro: group balance does not support keep_minibatch balancing; set fsdp_config.zorro.group_balance=false "
           "or on_unsupported=warn (verl's balancing then runs for such steps, counted in zorro/balance_fallbacks).")
    if settings.on_unsupported == "raise":
        raise ValueError(msg)
    logger.warning(msg)
    metrics["zorro/balance_fallbacks"] = metrics.get("zorro/balance_fallbacks", 0) + 1


def _log_balance(metrics: dict, seqlens: list[int], bal: DPBalance, prefix: str) -> None:
    """verl's balance statistics over the reordered batch, plus zorro's."""
    from verl.utils.seqlen_balancing import log_seqlen_unbalance

    perm = bal.permutation()
    parts, start = [], 0
    for rows in bal.ranks:  # partitions in the reordered batch's index space
        parts.append(list(range(start, start + len(rows))))
        start += len(rows)
    metrics.update(log_seqlen_unbalance(seqlen_list=[seqlens[i] for i in perm], partitions=parts, prefix=prefix))
    metrics["zorro/balance_split_groups"] = bal.split_groups
    metrics["zorro/balance_max_rank_cost"] = max(bal.costs) if bal.costs else 0


def _wrap_balance_batch(cls, balance) -> None:
    """Replace ``cls._balance_batch`` (once) by: the stock method unless zorro and ``group_balance`` are on (or
    ``keep_minibatch`` is asked, which group balancing does not support), else ``balance(self, batch, metrics,
    logging_prefix)``."""
    orig = cls._balance_batch
    if getattr(orig, "_zorro_hook", False):
        return

    @functools.wraps(orig)
    def _balance_batch(self, batch, metrics, logging_prefix="global_seqlen", keep_minibatch=False):
        settings = trainer_zorro_settings(self.config)
        if not (settings.enable and settings.group_balance):
            return orig(self, batch, metrics, logging_prefix=logging_prefix, keep_minibatch=keep_minibatch)
        if keep_minibatch:
            _unsupported_keep_minibatch(settings, metrics)
            return orig(self, batch, metrics, logging_prefix=logging_prefix, keep_minibatch=keep_minibatch)
        return balance(self, batch, metrics, logging_prefix)

    _balance_batch._zorro_hook = True
    cls._balance_batch = _balance_batch


def install_v0_hook(module) -> None:
    """Wrap ``verl.trainer.ppo.ray_trainer.RayPPOTrainer._balance_batch`` (``DataProto`` batches), once."""

    def balance(self, batch, metrics, logging_prefix):
        dp_size = self._get_dp_size(self.actor_rollout_wg, "actor")
        am = batch.batch["attention_mask"]
        bal = group_balance(batch.batch["prompts"], am, dp_size)
        seqlens = am.sum(-1).tolist()
        batch.reorder(torch.tensor(bal.permutation(), dtype=torch.long))
        _log_balance(metrics, seqlens, bal, logging_prefix)

    _wrap_balance_batch(module.RayPPOTrainer, balance)


def v1_group_of_key(key: str) -> str:
    """V1 trajectory keys are ``{uid}_{session_id}_{index}``: the group is the prompt ``uid``."""
    parts = str(key).rsplit("_", 2)
    return parts[0] if len(parts) == 3 else str(key)


def install_v1_hook(module) -> None:
    """Wrap ``verl.trainer.ppo.v1.trainer_base.PPOTrainer._balance_batch`` (``KVBatchMeta`` batches), once.

    Groups come from the key's ``uid``; costs from the ``prompt_len`` / ``response_len`` tags. Padding rows added by
    verl's upsampling are their own groups.
    """

    def balance(self, batch, metrics, logging_prefix):
        worker_group = self.actor_rollout_wg
        if "actor" not in worker_group._dispatch_info:
            worker_group._dispatch_info["actor"] = worker_group._query_dispatch_info("actor")
        dp_size = max(worker_group._dispatch_info["actor"]) + 1
        batch = module.upsample_batch_to_divisible_size(batch, self._get_required_batch_multiple(dp_size),
                                                        self.tokenizer.eos_token_id)
        labels: dict[str, int] = {}
        g = [labels.setdefault(v1_group_of_key(k), len(labels)) for k in batch.keys]
        p = [int(t.get("prompt_len", 0)) for t in batch.tags]
        r = [int(t.get("response_len", t["seq_len"] - t.get("prompt_len", 0))) for t in batch.tags]
        # verl's synthetic padding rows (upsampling) are no-ops: each its own group
        for i, t in enumerate(batch.tags):
            if t.get("is_padding") or "prompt_len" not in t:
                g[i] = len(labels) + i
        bal = balance_groups_across_ranks(g, p, r, dp_size, equal_size=True)
        batch.reorder(bal.permutation())
        _log_balance(metrics, [int(t["seq_len"]) for t in batch.tags], bal, logging_prefix)
        return batch

    _wrap_balance_batch(module.PPOTrainer, balance)
