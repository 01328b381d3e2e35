"""Group-aware DP balancing for the verl >= 0.9 trainers' ``_balance_batch`` (docs/design/packing.md).

verl's balancing spreads a prompt's rollouts over DP ranks by sequence length, so each rank sees most prompts once
per group member and deduplication saves little on multi-GPU runs. With zorro enabled and ``zorro.group_balance:
true`` (the default) the hook places rows by ``zorro.group_balance_mode``:

* ``keep_minibatches`` (default): verl's own balancing runs first, then rows move between DP ranks only among
  positions that feed the same optimizer steps — the same mini-batch of every epoch of the actor (and of the critic
  when there is one), as verl's worker cuts them, shuffling included (:func:`trainer_minibatch_slots`, which runs
  verl's own mini-batch iterator). Each mini-batch therefore holds exactly the rows it holds in a stock run: same
  loss normalisers, same optimizer steps; a group's rows inside a mini-batch sit on one rank where they fit.
* ``whole_groups`` (opt-in, warned once): whole groups are bin-packed by deduplicated token cost onto ranks and
  into the mini-batches each rank is cut into (``ppo_mini_batch_size * rollout.n / dp`` rows, in order):
  more deduplication, but the rows sharing an optimizer step differ from a stock run's.

Ranks always get equal row counts (verl dispatches equal chunks), so a group is split only when it cannot fit
(``zorro/balance_split_groups``, ``zorro/balance_minibatch_split_groups``). Balancing never stops a run: an error
inside it is warned once and counted in ``zorro/balance_fallbacks`` (``keep_minibatches`` then keeps verl's placement,
``whole_groups`` runs verl's balancing). With zorro disabled or ``group_balance: false``, verl's own balancing runs
unchanged. With ``zorro.sharing: prefix`` the units are trie clusters (rows sharing anything) costed by their prefix
tree (:func:`tree_balance`, :func:`v1_tree_costs`).
"""
from __future__ import annotations

import functools
import logging
from collections import Counter

import torch

from zorro_verl.integrations.verl.settings import ZorroSettings, engine_node_key
from zorro_verl.integrations.verl.v09.markers import mark_balanced
from zorro_verl.packing import group_ids
from zorro_verl.packing.microbatch import DPBalance, balance_groups_across_ranks, regroup_within_slots
from zorro_verl.packing.tree import tree_row_costs

__all__ = ["group_balance", "tree_balance", "v1_tree_costs", "install_v0_hook", "install_v1_hook",
           "install_one_step_off_hook", "BALANCE_STEPS_AHEAD_ATTR",
           "verl_minibatch_ids", "trainer_minibatch_slots",
           "trainer_zorro_settings", "v1_group_of_key",
           "v1_session_of_key"]

logger = logging.getLogger(__name__)

#: Warnings already given in this process (each reason once).
_warned: set[str] = set()


def _warn_once(reason: str, msg: str, *args, exc_info=None) -> None:
    if reason not in _warned:
        _warned.add(reason)
        logger.warning(msg, *args, exc_info=exc_info)


def _count(metrics: dict, key: str, n: float = 1) -> None:
    metrics[key] = metrics.get(key, 0) + n


def group_balance(prompts: torch.Tensor, attention_mask: torch.Tensor, dp_size: int,
                  minibatches_per_rank: int = 1) -> DPBalance:
    """Place whole groups on ranks (and on the ``minibatches_per_rank`` mini-batches of each rank).

    Args:
        prompts: ``[B, Pw]`` left-padded prompt ids; attention_mask: ``[B, Pw + R]`` (0 on both pads).
        dp_size: data-parallel ranks.
        minibatches_per_rank: mini-batches the trainer cuts each rank's rows into (see
            :func:`~zorro_verl.packing.microbatch.balance_groups_across_ranks`).

    Returns:
        :class:`DPBalance`; ``permutation()`` is the reorder index for ``batch.reorder``.
    """
    g, p, r = _prompt_group_costs(prompts, attention_mask)
    return balance_groups_across_ranks(g, p, r, dp_size, equal_size=True, minibatches_per_rank=minibatches_per_rank)


def _prompt_group_costs(prompts: torch.Tensor, attention_mask: torch.Tensor):
    """``(groups [B], prompt_lens [B], response_lens [B])`` from left-padded ``prompts [B, Pw]`` and verl's
    ``attention_mask [B, Pw + R]``: groups of identical valid prompt tokens."""
    pw = prompts.shape[1]
    pm = attention_mask[:, :pw] != 0
    return group_ids(prompts, pm), pm.sum(1), (attention_mask[:, pw:] != 0).sum(1)


def _tree_group_costs(input_ids: torch.Tensor, attention_mask: torch.Tensor, response_width: int,
                      min_shared_len: int):
    """``(clusters, root_lens, own_lens)`` per row for ``sharing=prefix``: trie clusters costed by their prefix tree
    (:func:`~zorro_verl.packing.tree.tree_row_costs`)."""
    tc = tree_row_costs(input_ids, attention_mask, response_width, min_shared_len)
    return tc["cluster"], tc["root_len"], tc["own"]


def tree_balance(input_ids: torch.Tensor, attention_mask: torch.Tensor, response_width: int, dp_size: int,
                 minibatches_per_rank: int = 1, min_shared_len: int = 64) -> DPBalance:
    """:func:`group_balance` for ``sharing=prefix``: whole trie clusters (rows sharing anything) on ranks, each
    costing its prefix tree's tokens (:func:`~zorro_verl.packing.tree.tree_row_costs`: the root once, every inner
    node once). ``input_ids [B, Pw + R]``, ``attention_mask [B, Pw + R]`` in verl's layout."""
    g, p, r = _tree_group_costs(input_ids, attention_mask, response_width, min_shared_len)
    return balance_groups_across_ranks(g, p, r, dp_size, equal_size=True, minibatches_per_rank=minibatches_per_rank)


def v1_tree_costs(keys: list, tags: list) -> tuple[list, list, list]:
    """V1 tags (no tokens) under ``sharing=prefix``: every output of one ``uid`` shares its first prompt (the
    cluster's root, the shortest ``prompt_len`` of the uid), and the outputs of one session are nested (output
    ``i > 0`` carries the conversation so far), so a session costs its longest output beyond the root, paid by
    that output. Returns ``(cluster, root_len, own)`` per row (padding rows: their own clusters)."""
    labels: dict[str, int] = {}
    g = [labels.setdefault(v1_group_of_key(k), len(labels)) for k in keys]
    seq = [int(t.get("seq_len", 0)) for t in tags]
    real = [not t.get("is_padding") and "prompt_len" in t for t in tags]
    root: dict[int, int] = {}
    longest: dict[str, int] = {}
    for i, (k, t) in enumerate(zip(keys, tags)):
        if real[i]:
            root[g[i]] = min(root.get(g[i], 1 << 62), int(t["prompt_len"]))
            s = v1_session_of_key(k)
            if s not in longest or seq[i] > seq[longest[s]]:
                longest[s] = i
    payer = set(longest.values())
    cluster, root_len, own = [], [], []
    for i in range(len(keys)):
        if not real[i]:
            cluster.append(len(labels) + i)
            root_len.append(int(tags[i].get("prompt_len", 0)))
            own.append(max(0, seq[i] - root_len[-1]))
            continue
        cluster.append(g[i])
        root_len.append(root[g[i]])
        own.append(seq[i] - root[g[i]] if i in payer else 0)
    return cluster, root_len, own


def trainer_zorro_settings(config) -> ZorroSettings:
    """The actor's zorro settings from the trainer config: its engine node's ``zorro`` (``megatron`` for strategy
    ``megatron``, else ``fsdp_config``); disabled when the node has no ``zorro`` key."""
    actor = config.actor_rollout_ref.actor
    node = actor.get(engine_node_key(actor.get("strategy", None)), {}) or {}
    return ZorroSettings.from_mapping(node.get("zorro", {}) or {})


def _unsupported_keep_minibatch(settings: ZorroSettings, metrics: dict) -> None:
    msg = ("zorro: group balance does not support keep_minibatch balancing; set fsdp_config.zorro.group_balance=false "
           "or on_unsupported=warn (verl's balancing then runs for such steps, counted in zorro/balance_fallbacks).")
    if settings.on_unsupported == "raise":
        raise ValueError(msg)
    _warn_once("keep_minibatch", msg)
    _count(metrics, "zorro/balance_fallbacks")


def minibatches_per_rank(config, batch_size: int, dp_size: int, metrics: dict) -> int:
    """How many mini-batches the trainer will cut each rank's rows into, for :func:`group_balance`.

    verl's trainers (V1 and ``RayPPOTrainer``) hand each rank ``B / dp`` rows and the worker's ``train_mini_batch``
    cuts them, in order, into chunks of ``ppo_mini_batch_size * rollout.n / dp`` rows — shuffled first when
    ``actor.shuffle`` is true. Returns 1 (rank-level balancing only) when the slots cannot be known: with
    ``shuffle=true`` (warned once, counted in ``zorro/balance_shuffled``) or when the batch does not divide into
    whole mini-batches (warned once, counted in ``zorro/balance_minibatch_misaligned``).
    """
    actor = config.actor_rollout_ref.actor
    if bool(actor.get("shuffle", False)):
        _warn_once("shuffle", "zorro: actor.shuffle=true shuffles each rank's rows before cutting mini-batches, so a "
                   "prompt's rollouts land in different mini-batches and each pays its prompt again (lower "
                   "zorro/dedup_ratio). Set actor_rollout_ref.actor.shuffle=false to keep groups in one mini-batch. "
                   "Counted in zorro/balance_shuffled.")
        _count(metrics, "zorro/balance_shuffled")
        return 1
    mini = actor.get("ppo_mini_batch_size", None)
    n = config.actor_rollout_ref.get("rollout", {}).get("n", 1) or 1
    if not mini:
        return 1
    global_mini = int(mini) * int(n)
    if global_mini % dp_size or batch_size % global_mini or batch_size % dp_size:
        _warn_once("misaligned", "zorro: the batch (%d rows) does not split into whole mini-batches of "
                   "ppo_mini_batch_size * rollout.n = %d rows over %d DP ranks; balancing keeps groups per rank "
                   "only, so groups may straddle mini-batch boundaries. Counted in "
                   "zorro/balance_minibatch_misaligned.", batch_size, global_mini, dp_size)
        _count(metrics, "zorro/balance_minibatch_misaligned")
        return 1
    return batch_size // global_mini


def _balance_metrics(metrics: dict, bal: DPBalance, dp_size: int) -> None:
    """zorro's balance metrics; warns once when a rank's rows mostly belong to groups split across ranks."""
    metrics["zorro/balance_split_groups"] = bal.split_groups
    metrics["zorro/balance_minibatch_split_groups"] = bal.minibatch_split_groups
    metrics["zorro/balance_max_rank_cost"] = max(bal.costs) if bal.costs else 0
    partial = sum(1 for rows, s in zip(bal.ranks, bal.split_rows) if rows and 2 * s > len(rows))
    metrics["zorro/balance_partial_ranks"] = partial
    if partial and dp_size > 1:
        _warn_once("partial", "zorro: on %d of %d DP ranks most rows belong to prompt groups split across ranks, so "
                   "deduplication saves little there (groups larger than a rank's share, or uneven group sizes). "
                   "Use a batch of whole groups per rank (train_batch_size * rollout.n divisible by the DP size "
                   "times rollout.n). Counted in zorro/balance_partial_ranks.", partial, dp_size)


def _check_group_sizes(metrics: dict, sizes: list[int], rollout_n) -> None:
    """Compare observed rollouts per prompt with ``zorro.rollout_n``; warn once and count differing groups."""
    if not rollout_n:
        return
    partial = sum(1 for s in sizes if s != rollout_n)
    metrics["zorro/balance_partial_groups"] = partial
    if partial:
        _warn_once("rollout_n", "zorro: %d of %d prompts have a number of rollouts other than zorro.rollout_n=%d "
                   "(filtered or failed samples, or a rollout_n that does not match actor_rollout_ref.rollout.n); "
                   "results are unaffected (groups are found from tokens). Counted in "
                   "zorro/balance_partial_groups.", partial, len(sizes), rollout_n)


def _check_micro_batch_size(metrics: dict, config, rollout_n) -> None:
    """Fixed-size micro-batches hold whole groups only when ``ppo_micro_batch_size_per_gpu`` is a multiple of
    ``zorro.rollout_n``; warn once and count (``zorro/balance_micro_batch_misaligned``) otherwise."""
    actor = config.actor_rollout_ref.actor
    mbs = actor.get("ppo_micro_batch_size_per_gpu", None)
    if not rollout_n or not mbs or bool(actor.get("use_dynamic_bsz", False)) or int(mbs) % rollout_n == 0:
        return
    _warn_once("micro_batch", "zorro: ppo_micro_batch_size_per_gpu=%d is not a multiple of zorro.rollout_n=%d, so "
               "fixed-size micro-batches cut prompt groups (each piece pays its prompt again; counted in "
               "zorro/split_groups). Use a multiple of rollout_n, or use_dynamic_bsz=true. Counted in "
               "zorro/balance_micro_batch_misaligned.", int(mbs), rollout_n)
    metrics["zorro/balance_micro_batch_misaligned"] = 1


def _log_balance(metrics: dict, seqlens: list[int], bal: DPBalance, prefix: str, dp_size: int) -> None:
    """verl's balance statistics over the reordered batch, plus zorro's."""
    from verl.utils.seqlen_balancing import log_seqlen_unbalance

    perm = bal.permutation()
    parts, start = [], 0
    for rows in bal.ranks:  # partitions in the reordered batch's index space
        parts.append(list(range(start, start + len(rows))))
        start += len(rows)
    metrics.update(log_seqlen_unbalance(seqlen_list=[seqlens[i] for i in perm], partitions=parts, prefix=prefix))
    _balance_metrics(metrics, bal, dp_size)


def _dp_size(worker_group, mesh: str) -> int:
    """Data-parallel size of the mesh ``mesh`` in ``worker_group`` (verl's ``_get_dp_size``: the dispatch info,
    cached)."""
    info = worker_group._dispatch_info
    if mesh not in info:
        info[mesh] = worker_group._query_dispatch_info(mesh)
    return max(info[mesh]) + 1


def critic_mesh_name() -> str:
    """The mesh the trainer dispatches the critic's update on: the one verl's ``TrainingWorker.train_mini_batch``
    (what ``_update_critic`` calls on the critic worker group) is registered with — ``"train"`` in verl 0.9.1; the
    critic worker registers no ``"critic"`` mesh. Read from verl's own registration, so a verl that renames it is
    followed."""
    from verl.single_controller.base.decorator import MAGIC_ATTR
    from verl.workers.engine_workers import TrainingWorker

    dispatch = getattr(TrainingWorker.train_mini_batch, MAGIC_ATTR)["dispatch_mode"]["dispatch_fn"]
    return dispatch.args[0]


def verl_minibatch_ids(batch_size: int, dp_size: int, mini_batch_size: int, epochs: int, seed: int,
                       shuffle: bool) -> list[tuple]:
    """Which optimizer steps each position of the dispatched batch feeds, as verl's worker cuts them.

    verl hands rank ``k`` the ``k``-th of ``dp_size`` equal consecutive chunks, and its worker
    (``train_mini_batch``) iterates ``verl.utils.tensordict_utils.make_iterator(chunk, mini_batch_size / dp_size,
    epochs, seed=seed + k, shuffle)``; the ``j``-th mini-batch of every rank is one optimizer step. This runs that
    same iterator over position indices, so the answer is verl's own, shuffling included.

    Returns:
        ``[batch_size]`` tuples: for each epoch, the index of the optimizer step (``epoch * steps_per_epoch + j``)
        that position takes part in.
    """
    from verl.utils import tensordict_utils as tu

    if batch_size % dp_size or mini_batch_size % dp_size or (batch_size // dp_size) % (mini_batch_size // dp_size):
        raise ValueError(f"the batch ({batch_size} rows) does not split into mini-batches of {mini_batch_size} rows "
                         f"over {dp_size} DP ranks (verl's worker would refuse it too)")
    chunk, mini = batch_size // dp_size, mini_batch_size // dp_size
    ids: list[list[int]] = [[] for _ in range(batch_size)]
    for k in range(dp_size):
        td = tu.get_tensordict({"position": torch.arange(chunk)})
        it = tu.make_iterator(td, mini_batch_size=mini, epochs=epochs, seed=seed + k,
                              dataloader_kwargs={"shuffle": shuffle})
        for step, mb in enumerate(it):
            for i in mb["position"].tolist():
                ids[k * chunk + i].append(step)
    return [tuple(x) for x in ids]


def trainer_minibatch_slots(trainer, batch_size: int) -> list[tuple]:
    """For each position of the batch the trainer dispatches, every optimizer step it feeds: the actor's (when
    the actor updates this step) and the critic's (when there is one), each with its own DP size, mini-batch size
    (``ppo_mini_batch_size * rollout.n``), ``ppo_epochs``, ``shuffle`` and ``data_loader_seed`` as the trainers pass
    them to ``train_mini_batch``. Positions with equal slots are interchangeable for every consumer."""
    cfg = trainer.config
    n = int(cfg.actor_rollout_ref.rollout.get("n", 1) or 1)
    consumers = []  # (role, worker group, its mesh, its config node)
    # A trainer that balances the next step's batch while this step trains (OneStepOffRayTrainer: its rollout task
    # may finish before or after global_steps advances) sets BALANCE_STEPS_AHEAD_ATTR = 1: the actor's slots are
    # kept whenever the actor may update the batch (a superset of the constraints: verl's mini-batches still hold).
    ahead = int(getattr(trainer, BALANCE_STEPS_AHEAD_ATTR, 0) or 0)
    step = int(getattr(trainer, "global_steps", 0) or 0) + ahead
    if int(cfg.get("trainer", {}).get("critic_warmup", 0) or 0) <= step:
        consumers.append(("actor", trainer.actor_rollout_wg, "actor", cfg.actor_rollout_ref.actor))
    if getattr(trainer, "use_critic", False):
        consumers.append(("critic", trainer.critic_wg, critic_mesh_name(), cfg.critic))
    slots: list[tuple] = [() for _ in range(batch_size)]
    for role, wg, mesh, node in consumers:
        ids = verl_minibatch_ids(batch_size, _dp_size(wg, mesh), int(node.get("ppo_mini_batch_size")) * n,
                                 int(node.get("ppo_epochs", 1)), int(node.get("data_loader_seed", 42)),
                                 bool(node.get("shuffle", False)))
        slots = [s + (role,) + i for s, i in zip(slots, ids)]
    return slots


#: Class attribute of a trainer whose ``_balance_batch`` runs up to this many steps before the step that trains the
#: batch (:func:`trainer_minibatch_slots`); set by :func:`install_one_step_off_hook`.
BALANCE_STEPS_AHEAD_ATTR = "zorro_balance_steps_ahead"


def install_one_step_off_hook(module) -> None:
    """Post-import hook of ``verl.experimental.one_step_off_policy.ray_trainer``. ``OneStepOffRayTrainer`` (a
    ``SeparateRayPPOTrainer``, a ``RayPPOTrainer``) inherits the wrapped ``_balance_batch`` (:func:`install_v0_hook`)
    and calls it in ``_async_gen_next_batch``, the rollout of step ``k + 1`` that runs while step ``k`` trains; so
    its ``global_steps`` at balancing is ``k`` or ``k + 1``. Marks the class one step ahead
    (:data:`BALANCE_STEPS_AHEAD_ATTR`), which matters with ``critic_warmup > 0`` only."""
    setattr(module.OneStepOffRayTrainer, BALANCE_STEPS_AHEAD_ATTR, 1)


def _log_whole_groups_once() -> None:
    _warn_once("whole_groups", "zorro: group_balance_mode=whole_groups: whole prompt groups are packed into (rank, "
               "mini-batch) slots, so the rows that share an optimizer step differ from verl's own mini-batches "
               "(more deduplication, a different run than stock on the same rollouts). The default "
               "group_balance_mode=keep_minibatches keeps verl's mini-batches exactly.")


def _wrap_balance_batch(cls, rows_of, whole_groups) -> None:
    """Replace ``cls._balance_batch`` (once).

    * zorro off, or ``group_balance: false``: the stock method.
    * ``group_balance_mode: keep_minibatches`` (default): the stock method first (verl's own balancing, upsampling,
      ``keep_minibatch`` and all), then rows move between DP ranks only among positions that feed the same optimizer
      steps (:func:`trainer_minibatch_slots`, :func:`~zorro_verl.packing.microbatch.regroup_within_slots`); groups
      from ``rows_of(self, batch, settings, metrics) -> (groups, prompt_lens, response_lens, seqlens)``. An error
      there keeps verl's placement for that step (still exact; warned once, counted in ``zorro/balance_fallbacks``).
    * ``group_balance_mode: whole_groups`` (opt-in, warned once): ``whole_groups(self, batch, metrics,
      logging_prefix, settings)`` packs whole groups into (rank, mini-batch) slots; ``keep_minibatch`` is not
      supported there (raise, or warn and stock); an error runs verl's balancing (warned once, counted).
    """
    orig = cls._balance_batch
    if getattr(orig, "_zorro_hook", False):
        return

    def _placed(self, batch, metrics, logging_prefix, keep_minibatch):
        settings = trainer_zorro_settings(self.config)
        if not (settings.enable and settings.group_balance):
            return orig(self, batch, metrics, logging_prefix=logging_prefix, keep_minibatch=keep_minibatch)
        if settings.group_balance_mode == "keep_minibatches":
            out = orig(self, batch, metrics, logging_prefix=logging_prefix, keep_minibatch=keep_minibatch)
            target = batch if out is None else out  # V0 reorders in place and returns None; V1 returns the batch
            try:
                _keep_minibatches(self, target, metrics, logging_prefix, settings, rows_of)
            except Exception as e:  # verl's placement stands: the run stays stock's, only deduplication is lost
                _warn_once("error_keep", "zorro: regrouping inside verl's mini-batches failed (%s: %s); verl's "
                           "placement is kept for such steps (same training, less deduplication; counted in "
                           "zorro/balance_fallbacks). Please report this.", type(e).__name__, e, exc_info=True)
                _count(metrics, "zorro/balance_fallbacks")
            return out
        _log_whole_groups_once()
        if keep_minibatch:
            _unsupported_keep_minibatch(settings, metrics)
            return orig(self, batch, metrics, logging_prefix=logging_prefix, keep_minibatch=keep_minibatch)
        try:
            return whole_groups(self, batch, metrics, logging_prefix, settings)
        except Exception as e:  # never stop training over a placement heuristic; loud and counted instead
            _warn_once("error", "zorro: group-aware balancing failed (%s: %s); verl's balancing runs for such steps "
                       "(counted in zorro/balance_fallbacks). Please report this.", type(e).__name__, e,
                       exc_info=True)
            _count(metrics, "zorro/balance_fallbacks")
            return orig(self, batch, metrics, logging_prefix=logging_prefix, keep_minibatch=keep_minibatch)

    @functools.wraps(orig)
    def _balance_batch(self, batch, metrics, logging_prefix="global_seqlen", keep_minibatch=False):
        out = _placed(self, batch, metrics, logging_prefix, keep_minibatch)
        # the stamp the engine checks (markers.py): this batch went through zorro's hook, whatever it decided
        target = batch if out is None else out
        meta = getattr(target, "meta_info", None)
        mark_balanced(meta if meta is not None else target.extra_info)
        return out

    _balance_batch._zorro_hook = True
    cls._balance_batch = _balance_batch
    logger.warning("zorro: group-aware DP balancing installed in %s.%s", cls.__module__, cls.__qualname__)


def _keep_minibatches(trainer, batch, metrics: dict, logging_prefix: str, settings: ZorroSettings, rows_of) -> None:
    """Reorder ``batch`` (already in verl's balanced order) in place: rows change ranks only among positions with
    the same optimizer-step slots, so every mini-batch keeps exactly verl's global set of rows."""
    dp_size = _dp_size(trainer.actor_rollout_wg, "actor")
    slots = trainer_minibatch_slots(trainer, len(batch))
    g, p, r, seqlens = rows_of(trainer, batch, settings, metrics)
    bal = regroup_within_slots(g, p, r, slots, dp_size)
    perm = bal.permutation()
    batch.reorder(torch.tensor(perm, dtype=torch.long) if hasattr(batch, "batch") else perm)
    _log_balance(metrics, seqlens, bal, logging_prefix, dp_size)
    metrics["zorro/balance_minibatch_slots"] = bal.minibatches_per_rank


def _v0_rows(trainer, batch, settings: ZorroSettings, metrics: dict):
    """``(groups, prompt_lens, response_lens, seqlens)`` of a V0 ``DataProto`` batch, from its prompt tokens (trie
    clusters and their tree costs under ``sharing=prefix``); checks group sizes and the micro-batch size."""
    am = batch.batch["attention_mask"]
    if settings.sharing == "prefix":
        g, p, r = _tree_group_costs(batch.batch["input_ids"], am, batch.batch["responses"].shape[1],
                                    settings.min_shared_len)
    else:
        g, p, r = _prompt_group_costs(batch.batch["prompts"], am)
    uids = batch.non_tensor_batch.get("uid") if batch.non_tensor_batch else None
    if uids is not None:
        _check_group_sizes(metrics, list(Counter(str(u) for u in uids).values()), settings.rollout_n)
    _check_micro_batch_size(metrics, trainer.config, settings.rollout_n)
    return g, p, r, am.sum(-1).tolist()


def install_v0_hook(module) -> None:
    """Wrap ``verl.trainer.ppo.ray_trainer.RayPPOTrainer._balance_batch`` (``DataProto`` batches), once.

    Groups come from the prompt tokens. ``whole_groups`` packs rows into (rank, mini-batch) slots
    (:func:`minibatches_per_rank`).
    """

    def whole_groups(self, batch, metrics, logging_prefix, settings):
        dp_size = self._get_dp_size(self.actor_rollout_wg, "actor")
        m = minibatches_per_rank(self.config, len(batch), dp_size, metrics)
        g, p, r, seqlens = _v0_rows(self, batch, settings, metrics)
        bal = balance_groups_across_ranks(g, p, r, dp_size, equal_size=True, minibatches_per_rank=m)
        batch.reorder(torch.tensor(bal.permutation(), dtype=torch.long))
        _log_balance(metrics, seqlens, bal, logging_prefix, dp_size)

    _wrap_balance_batch(module.RayPPOTrainer, _v0_rows, whole_groups)


def v1_group_of_key(key: str) -> str:
    """V1 trajectory keys are ``{uid}_{session_id}_{index}``: the prompt ``uid``."""
    parts = str(key).rsplit("_", 2)
    return parts[0] if len(parts) == 3 else str(key)


def v1_session_of_key(key: str) -> str:
    """V1 trajectory keys are ``{uid}_{session_id}_{index}``: ``{uid}_{session_id}`` (one rollout of the prompt)."""
    parts = str(key).rsplit("_", 1)
    return parts[0] if len(parts) == 2 and "_" in parts[0] else str(key)


def _v1_rows(trainer, batch, settings: ZorroSettings, metrics: dict):
    """``(groups, prompt_lens, response_lens, seqlens)`` of a V1 ``KVBatchMeta`` from its keys and tags.

    A group is the key's ``uid`` **and** the ``prompt_len`` tag: an agent loop may store several outputs of one
    trajectory under one uid (``{uid}_{session}_{i}``), and output ``i > 0`` carries the accumulated conversation
    as its prompt, a different prompt. (Tags hold no prompt tokens, so two later turns of one uid with equal prompt
    lengths count as one group; that only skews the cost estimate — the engine finds the real groups from tokens.)
    Padding rows added by verl's upsampling are their own groups. Under ``sharing=prefix`` a uid's outputs form
    one trie cluster (:func:`v1_tree_costs`).
    """
    labels: dict[str, int] = {}
    g = [labels.setdefault(v1_group_of_key(k), len(labels)) for k in batch.keys]
    p = [int(t.get("prompt_len", 0)) for t in batch.tags]
    r = [int(t.get("response_len", t["seq_len"] - t.get("prompt_len", 0))) for t in batch.tags]
    sessions: dict[str, set] = {}
    for i, (k, t) in enumerate(zip(batch.keys, batch.tags)):
        if t.get("is_padding") or "prompt_len" not in t:
            g[i] = len(labels) + i
        else:
            sessions.setdefault(v1_group_of_key(k), set()).add(v1_session_of_key(k))
    _check_group_sizes(metrics, [len(s) for s in sessions.values()], settings.rollout_n)
    _check_micro_batch_size(metrics, trainer.config, settings.rollout_n)
    if settings.sharing == "prefix":
        g, p, r = v1_tree_costs(list(batch.keys), list(batch.tags))
    return g, p, r, [int(t["seq_len"]) for t in batch.tags]


def install_v1_hook(module) -> None:
    """Wrap ``verl.trainer.ppo.v1.trainer_base.PPOTrainer._balance_batch`` (``KVBatchMeta`` batches), once.

    Costs come from the ``prompt_len`` / ``response_len`` tags (:func:`_v1_rows`). ``whole_groups`` upsamples as
    verl does and packs rows into (rank, mini-batch) slots (:func:`minibatches_per_rank`).
    """

    def whole_groups(self, batch, metrics, logging_prefix, settings):
        dp_size = _dp_size(self.actor_rollout_wg, "actor")
        batch = module.upsample_batch_to_divisible_size(batch, self._get_required_batch_multiple(dp_size),
                                                        self.tokenizer.eos_token_id)
        g, p, r, seqlens = _v1_rows(self, batch, settings, metrics)
        m = minibatches_per_rank(self.config, len(g), dp_size, metrics)
        bal = balance_groups_across_ranks(g, p, r, dp_size, equal_size=True, minibatches_per_rank=m)
        batch.reorder(bal.permutation())
        _log_balance(metrics, seqlens, bal, logging_prefix, dp_size)
        return batch

    _wrap_balance_batch(module.PPOTrainer, _v1_rows, whole_groups)
