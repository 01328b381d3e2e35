"""verl 0.7 (legacy FSDP workers): a drop-in ``DataParallelPPOActor`` with zorro's deduplicated forward.

``ZoRRoDataParallelPPOActor`` changes three things of verl 0.7.1's ``DataParallelPPOActor`` and nothing else:

* ``_forward_micro_batch`` runs the model once on the packed dedup row of the micro-batch (each unique prompt once,
  every response after it; docs/design/math.md) through :func:`~zorro_verl.integrations.transformers.zorro_step`, and
  returns the same dict as the parent: ``log_probs`` and, when asked, ``entropys``, each ``[B, R]`` fp32, 0 on
  response pads. The call goes through the (FSDP-wrapped) root module, so FSDP's hooks run as in the stock
  forward.
* ``compute_log_prob`` forms micro-batches that keep prompt groups whole (``fixed_size_microbatches`` /
  ``dynamic_microbatches`` of :mod:`zorro_verl.packing.microbatch`; the dynamic budget counts deduplicated tokens)
  and restores the original row order. No loss is involved, so the result equals the stock actor's for any row
  order.
* ``update_policy`` keeps verl's mini-batch membership (optimizer steps are unchanged) and regroups rows only
  *inside* each mini-batch:

  - fixed micro-batch size: rows of a mini-batch are reordered so that siblings are adjacent, then the parent
    splits it into its usual ``ppo_micro_batch_size_per_gpu`` chunks (same count and sizes as stock, so verl's
    ``1 / gradient_accumulation`` loss scale is unchanged). Groups stay whole when the micro-batch size is a
    multiple of ``rollout_n`` (a warning says so otherwise).
  - dynamic batch size: the parent's ``prepare_dynamic_batch`` is swapped, for the duration of the call only, for
    a group-aware packing under the same ``ppo_max_token_len_per_gpu`` budget (verl 0.7 forms micro-batches inline
    and offers no hook).

  verl 0.7 aggregates the loss per micro-batch. With ``loss_agg_mode`` ``seq-mean-token-mean`` /
  ``seq-mean-token-sum`` the objective does not depend on which rows share a micro-batch, so losses and gradients
  equal the stock actor's for any row order. With ``token-mean`` each micro-batch is normalised by its own token
  count: the result equals the stock actor on the same membership, i.e. exactly when the batch already has
  siblings adjacent and fixed micro-batches hold whole groups (verl's default ``repeat(interleave=True)``
  layout); otherwise it equals the stock actor run on the mini-batches with siblings adjacent.

With ``sharing=prefix`` (docs/design/math.md) the plan of each micro-batch is the prefix tree of its rows (every
common prefix computed once: a system prompt shared by different questions, multi-turn samples nested in each
other) and every "group" above is a trie **cluster** (rows sharing a root): micro-batches keep clusters whole, and
the dynamic budget counts each shared token once (:func:`~zorro_verl.packing.tree.tree_row_costs`). The loss facts
are the same, with clusters for groups.

With zorro disabled the class *is* the parent (every method delegates). A batch without shared prompts keeps the
parent's micro-batching; only its forward is zorro's (bit-for-bit the same math up to float reassociation).

LoRA (verl wraps the actor in a ``PeftModel``; the reference is the actor under ``disable_adapter()``) runs through
the same forward (docs/design/model-step.md "LoRA (PEFT) models").

Unsupported settings (Ulysses > 1, fused kernels, prefix grouper, ``calculate_sum_pi_squared``,
``logits_optimization=memory``, LoRA dropout > 0, vision-language models or multimodal / 3-D position inputs) raise
``ValueError`` with ``on_unsupported=raise``; with ``warn`` they warn once and run the stock forward, counted in
``zorro/fallback_batches``. ``update_policy`` adds ``zorro/dedup_ratio`` (ordinary / deduplicated tokens of its
forwards), ``zorro/fallback_batches``, ``zorro/split_groups`` (and ``zorro/tree_depth`` with ``sharing=prefix``) to the
actor metrics; they cover every forward of the actor since the previous ``update_policy`` (so the step's old-log-prob
pass is included; verl 0.7's worker reports no metrics from ``compute_log_prob``).

Installation: :func:`install` (called by importing :mod:`zorro_verl.integrations.verl.v07.plugin`, e.g. through
``VERL_USE_EXTERNAL_MODULES`` or ``actor_rollout_ref.model.external_lib``) makes ``DataParallelPPOActor(config,
...)`` build this class whenever ``config.fsdp_config.zorro.enable`` is true — for the actor and the reference
policy, whatever name the worker bound the class to.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Optional

import torch
import verl.workers.actor.dp_actor as _dp_actor
from verl.utils.device import get_device_id
from verl.workers.actor.dp_actor import DataParallelPPOActor

from zorro_verl.integrations.transformers import install_zorro, is_installed, uninstall_zorro, zorro_step
from zorro_verl.integrations.transformers.lora import lora_unsupported
from zorro_verl.integrations.verl.common import ZorroActorMixin, dedup_metrics, setup_unsupported
from zorro_verl.integrations.verl.v07.config import legacy_settings_of
from zorro_verl.packing import build_plan, group_ids
from zorro_verl.packing.microbatch import dynamic_microbatches, fixed_size_microbatches, restore_permutation
from zorro_verl.packing.tree import DEFAULT_MIN_SHARED_LEN, tree_row_costs

__all__ = ["ZoRRoDataParallelPPOActor", "install", "uninstall", "is_routing_installed", "row_groups", "row_units"]

logger = logging.getLogger(__name__)


def row_groups(input_ids: torch.Tensor, attention_mask: torch.Tensor, response_width: int):
    """Group label, valid prompt length and valid response length of every row (one host sync).

    Args:
        input_ids: ``[B, S] int64`` verl layout (left-padded prompt ``[:, :S-R]`` + right-padded response).
        attention_mask: ``[B, S]`` 0/1.
        response_width: ``R``.

    Returns:
        ``(group [B], prompt_lens [B], response_lens [B])`` as Python lists. Rows with equal valid prompt tokens at
        equal columns share a label (labels are arbitrary ints). Only micro-batch sizing uses them: the plan finds
        the groups again from the tokens, so a coarser labelling never changes results.
    """
    S = input_ids.shape[1]
    Pw = S - response_width
    mask = attention_mask.bool()
    group = group_ids(input_ids[:, :Pw], mask[:, :Pw])
    p = mask[:, :Pw].sum(1)
    r = mask[:, Pw:].sum(1)
    return group.tolist(), p.tolist(), r.tolist()


def row_units(input_ids: torch.Tensor, attention_mask: torch.Tensor, response_width: int, sharing: str = "prompt",
              min_shared_len: int = DEFAULT_MIN_SHARED_LEN):
    """The micro-batching units of the rows under ``sharing`` (one host sync).

    Args:
        input_ids: ``[B, S] int64`` verl layout; attention_mask: ``[B, S]`` 0/1; response_width: ``R``.
        sharing: ``"prompt"`` (identical prompts, :func:`row_groups`) or ``"prefix"`` (trie clusters,
            :func:`~zorro_verl.packing.tree.tree_row_costs` with ``min_shared_len``).

    Returns:
        ``(group, prompt_lens, response_lens, split_response_lens)`` host lists ``[B]`` for
        :mod:`zorro_verl.packing.microbatch`. Prefix: ``group`` is the cluster, ``prompt_lens`` its root's tokens
        (paid once), ``response_lens`` the tokens below the root the row pays (a whole cluster costs its tree's
        tokens, so the budget counts every shared token once), ``split_response_lens`` a row's tokens below the
        root (the conservative cost in a piece of a cut cluster). Prompt: ``split_response_lens`` is None.
    """
    if sharing == "prefix":
        tc = tree_row_costs(input_ids, attention_mask, response_width, min_shared_len)
        return tc["cluster"], tc["root_len"], tc["own"], tc["below_root"]
    return (*row_groups(input_ids, attention_mask, response_width), None)


def _siblings_adjacent(group: list[int], start: int, stop: int) -> list[int]:
    """Rows ``start..stop-1`` ordered by (first row of their group in the range, row)."""
    first: dict[int, int] = {}
    for b in range(start, stop):
        first.setdefault(group[b], b)
    return sorted(range(start, stop), key=lambda b: (first[group[b]], b))


def _split_groups(group: list[int], chunks: list[list[int]]) -> int:
    owners: dict[int, set] = {}
    for i, rows in enumerate(chunks):
        for b in rows:
            owners.setdefault(group[b], set()).add(i)
    return sum(1 for s in owners.values() if len(s) > 1)


class ZoRRoDataParallelPPOActor(ZorroActorMixin, DataParallelPPOActor):
    """verl 0.7 ``DataParallelPPOActor`` with zorro's deduplicated micro-batch forward (see the module docstring).

    Args:
        config: the actor / ref config (``FSDPActorConfig`` or its OmegaConf node); zorro's settings are read from
            ``config.fsdp_config.zorro`` (:func:`~zorro_verl.integrations.verl.v07.config.legacy_settings_of`).
        actor_module: the (FSDP-wrapped) ``*ForCausalLM``.
        actor_optimizer: ``None`` for the reference policy.
    """

    def __init__(self, config, actor_module: torch.nn.Module, actor_optimizer: Optional[torch.optim.Optimizer] = None):
        super().__init__(config, actor_module, actor_optimizer)
        self._zorro_setup(legacy_settings_of(config), self.device_name)
        self._zorro_reset_counters()
        if not self.zorro.enable:
            return
        if self.zorro_active:
            # Probe-free: every forward checks one zorro call per attention / linear-attention layer (a probe
            # would call submodules outside the FSDP root's forward).
            install_zorro(self.actor_module, probe=False)
        logger.warning("zorro: legacy actor (%s) %s; backend=%s, logits=%s, on_unsupported=%s",
                       "ref" if actor_optimizer is None else "actor",
                       "deduplicated forward" if self.zorro_active else f"stock forward: {self._zorro_static_reason}",
                       self._zorro_backend, self.zorro.logits_optimization, self.zorro.on_unsupported)

    # ------------------------------------------------------------------ support checks
    def _zorro_static_unsupported(self) -> Optional[str]:
        reason = (setup_unsupported(self.ulysses_sequence_parallel_size,
                                    hf_config=getattr(self.actor_module, "config", None))
                  or lora_unsupported(self.actor_module))
        if reason is not None:
            return reason
        if self.use_fused_kernels:
            return "fused kernels (set actor_rollout_ref.model.use_fused_kernels=false)"
        if self.use_prefix_grouper:
            return "use_prefix_grouper (verl's own prefix sharing; disable it, zorro replaces it)"
        if self.config.get("calculate_sum_pi_squared", False):
            return "calculate_sum_pi_squared=True"
        if self.zorro.logits_optimization == "memory":
            return "logits_optimization=memory in the legacy actor (use none or compute)"
        return None

    @staticmethod
    def _zorro_batch_unsupported(micro_batch: dict) -> Optional[str]:
        if "multi_modal_inputs" in micro_batch:
            return "multimodal inputs"
        if micro_batch["position_ids"].dim() == 3:
            return "3-D position ids (mrope)"
        return None

    # ------------------------------------------------------------------ counters -> metrics
    def _zorro_reset_counters(self) -> None:
        self._zorro_counts = {"ordinary_tokens": 0, "dedup_tokens": 0, "fallback_batches": 0, "split_groups": 0,
                              "tree_depth": 0}

    def zorro_metrics(self, reset: bool = True) -> dict:
        """Metrics of the forwards since the last reset (:func:`~zorro_verl.integrations.verl.common.dedup_metrics`):
        ``zorro/dedup_ratio`` (ordinary / deduplicated tokens; ``sharing=prefix``: ordinary tokens over the trees'
        tokens), ``zorro/prompt_tokens_saved``, ``zorro/fallback_batches`` (micro-batches run by the stock forward),
        ``zorro/split_groups`` (groups, or trie clusters, cut across micro-batches) and, with ``sharing=prefix``,
        ``zorro/tree_depth`` (node levels of the deepest tree), as the verl 0.9 engine reports them."""
        c = self._zorro_counts
        out = dedup_metrics(c["ordinary_tokens"], c["dedup_tokens"], c["split_groups"], c["fallback_batches"])
        if self.zorro.sharing == "prefix":
            out["zorro/tree_depth"] = float(c["tree_depth"])
        if reset:
            self._zorro_reset_counters()
        return out

    # ------------------------------------------------------------------ forward
    def _zorro_attention(self, on: bool) -> None:
        """Set the model's attention for the forward about to run. It stays so until the next forward, since verl
        runs this micro-batch's backward (and any checkpoint recompute in it) after the forward returns."""
        if on and not is_installed(self.actor_module):
            install_zorro(self.actor_module, probe=False)
        elif not on and is_installed(self.actor_module):
            uninstall_zorro(self.actor_module)

    def _forward_micro_batch(self, micro_batch: dict, temperature: float, calculate_entropy: bool = False) -> dict:
        """Same contract as the parent: ``{"log_probs": [B, R], "entropys": [B, R] (if asked)}``, fp32."""
        if not self.zorro.enable:
            return super()._forward_micro_batch(micro_batch, temperature=temperature,
                                                calculate_entropy=calculate_entropy)
        reason = self._zorro_static_reason or self._zorro_batch_unsupported(micro_batch)
        if reason is not None:
            if self._zorro_static_reason is None:
                self._zorro_unsupported(reason)
            self._zorro_attention(False)
            self._zorro_counts["fallback_batches"] += 1
            return super()._forward_micro_batch(micro_batch, temperature=temperature,
                                                calculate_entropy=calculate_entropy)
        self._zorro_attention(True)

        R = micro_batch["responses"].size(-1)
        plan = build_plan(micro_batch["input_ids"], micro_batch["attention_mask"], R,
                          position_ids=micro_batch["position_ids"], **self.zorro.plan_kwargs())
        self._zorro_counts["ordinary_tokens"] += plan.ordinary_tokens
        self._zorro_counts["dedup_tokens"] += plan.T  # a tree plan's T: every shared prefix once
        if plan.tree is not None:
            self._zorro_counts["tree_depth"] = max(self._zorro_counts["tree_depth"], plan.tree.levels)
        with torch.autocast(device_type=self.device_name, dtype=self.param_dtype):  # same autocast as the parent
            # temperature_op="logits": the parent's logits_rmpad.div_(temperature) on the model-dtype logits
            logp, ent = zorro_step(self.actor_module, plan, backend=self._zorro_backend,
                                   temperature=float(temperature), calculate_entropy=calculate_entropy,
                                   logits_optimization=self.zorro.logits_optimization,
                                   chunk_size=self.logits_chunk_size, temperature_op="logits")
        outputs = {"log_probs": plan.to_padded(logp)}  # [B, R], 0 on pads like the parent's remove-padding path
        if calculate_entropy:
            outputs["entropys"] = plan.to_padded(ent)
        return outputs

    # ------------------------------------------------------------------ micro-batching
    def _units(self, batch):
        """:func:`row_units` of a batch under this actor's ``sharing``."""
        return row_units(batch["input_ids"], batch["attention_mask"], batch["responses"].size(-1),
                         self.zorro.sharing, self.zorro.min_shared_len)

    def compute_log_prob(self, data, calculate_entropy: bool = False) -> dict:
        """Parent's contract (``log_probs`` / ``entropys`` ``[B, R]`` in the original row order) with group-aware
        micro-batches (prompt groups, or trie clusters with ``sharing=prefix``): fixed ``micro_batch_size`` rows or
        a deduplicated ``max_token_len`` budget."""
        if not self.zorro_active or "multi_modal_inputs" in data.non_tensor_batch:
            return super().compute_log_prob(data, calculate_entropy=calculate_entropy)
        g, p, r, r_split = self._units(data.batch)
        if len(set(g)) == len(g):  # nothing shared: keep the parent's micro-batches
            return super().compute_log_prob(data, calculate_entropy=calculate_entropy)

        self.actor_module.eval()
        temperature = data.meta_info["temperature"]  # required, as in the parent
        pad_token_id = data.meta_info.get("pad_token_id", 0)
        if data.meta_info["use_dynamic_bsz"]:
            mbs = dynamic_microbatches(g, p, r, int(data.meta_info["max_token_len"]), split_response_lens=r_split)
        else:
            mbs = fixed_size_microbatches(g, p, r, int(data.meta_info["micro_batch_size"]))
        self._zorro_counts["split_groups"] += mbs.split_groups
        data = data.select(batch_keys=["responses", "input_ids", "attention_mask", "position_ids"])
        log_probs, entropys = [], []
        for rows in mbs.batches:
            mb = data.select_idxs(torch.tensor(rows, dtype=torch.long)).to(get_device_id())
            model_inputs = {**mb.batch, **mb.non_tensor_batch, "pad_token_id": pad_token_id}
            with torch.no_grad():
                out = self._forward_micro_batch(model_inputs, temperature=temperature,
                                                calculate_entropy=calculate_entropy)
            log_probs.append(out["log_probs"])
            if calculate_entropy:
                entropys.append(out["entropys"])
        perm = restore_permutation(mbs.batches).to(log_probs[0].device)
        outputs = {"log_probs": torch.cat(log_probs)[perm]}
        if calculate_entropy:
            outputs["entropys"] = torch.cat(entropys)[perm]
        return outputs

    def update_policy(self, data) -> dict:
        """Parent's ``update_policy`` with group-aware micro-batches inside each (unchanged) mini-batch; adds the
        ``zorro/*`` metrics."""
        if not self.zorro_active:
            metrics = super().update_policy(data)
            if self.zorro.enable:
                metrics.update(self.zorro_metrics())
            return metrics
        g = self._units(data.batch)[0]
        if len(set(g)) == len(g):  # nothing shared: the parent's micro-batches, zorro's forward
            metrics = super().update_policy(data)
            metrics.update(self.zorro_metrics())
            return metrics

        B = len(g)
        mini = int(self.config.ppo_mini_batch_size)
        order = [b for s in range(0, B, mini) for b in _siblings_adjacent(g, s, min(s + mini, B))]
        if order != list(range(B)):
            data = data.select_idxs(torch.tensor(order, dtype=torch.long))  # a copy: the caller's data is untouched
            g = [g[b] for b in order]
        if self.config.use_dynamic_bsz:
            with self._group_aware_dynamic_batches():
                metrics = super().update_policy(data)
        else:
            mbs = int(self.config.ppo_micro_batch_size_per_gpu)
            n = self.zorro.rollout_n
            if n is not None and mbs % n and "micro_size" not in self._zorro_warned:
                self._zorro_warned.add("micro_size")
                logger.warning("zorro: ppo_micro_batch_size_per_gpu=%d is not a multiple of rollout_n=%d; groups are "
                               "split at micro-batch boundaries (zorro/split_groups) and pay their prompt twice. "
                               "Use a multiple of rollout_n.", mbs, n)
            for s in range(0, B, mini):
                chunks = [list(range(c, min(c + mbs, s + mini, B))) for c in range(s, min(s + mini, B), mbs)]
                self._zorro_counts["split_groups"] += _split_groups(g, chunks)
            metrics = super().update_policy(data)
        metrics.update(self.zorro_metrics())
        return metrics

    @contextmanager
    def _group_aware_dynamic_batches(self):
        """Swap ``dp_actor.prepare_dynamic_batch`` (looked up by the parent's ``update_policy`` at call time) for the
        group-aware packing, for this call only. verl's legacy workers run one ``update_policy`` at a time."""
        original = _dp_actor.prepare_dynamic_batch

        def prepare(mini_batch, max_token_len, **_kwargs):
            g, p, r, r_split = self._units(mini_batch.batch)
            mbs = dynamic_microbatches(g, p, r, int(max_token_len), split_response_lens=r_split)
            self._zorro_counts["split_groups"] += mbs.split_groups
            return [mini_batch.select_idxs(torch.tensor(rows, dtype=torch.long)) for rows in mbs.batches], mbs.batches

        _dp_actor.prepare_dynamic_batch = prepare
        try:
            yield
        finally:
            _dp_actor.prepare_dynamic_batch = original


# ---------------------------------------------------------------------- installation
_ROUTER_FLAG = "_zorro_router"


def _routing_new(cls, *args, **kwargs):
    """``DataParallelPPOActor.__new__``: build the zorro actor when the config enables zorro."""
    config = args[0] if args else kwargs.get("config")
    target = cls
    if cls is DataParallelPPOActor and legacy_settings_of(config).enable:
        target = ZoRRoDataParallelPPOActor
    return object.__new__(target)


_routing_new._zorro_router = True


def install() -> None:
    """Make ``DataParallelPPOActor(config, ...)`` return a :class:`ZoRRoDataParallelPPOActor` whenever
    ``config.fsdp_config.zorro.enable`` is true (idempotent).

    verl 0.7's ``init_model`` binds ``DataParallelPPOActor`` before it imports ``external_lib``, so replacing the
    name would come too late there; routing in ``__new__`` works for every binding. Configs without zorro (or with
    ``enable: false``) still get the stock class.
    """
    if is_routing_installed():
        return
    DataParallelPPOActor.__new__ = staticmethod(_routing_new)


def _plain_new(cls, *args, **kwargs):
    return object.__new__(cls)


def uninstall() -> None:
    """Undo :func:`install`: every config builds the stock class again. (A plain ``__new__`` stays in place:
    deleting an assigned ``__new__`` leaves CPython's ``object.__new__`` rejecting the constructor arguments.)"""
    if is_routing_installed():
        DataParallelPPOActor.__new__ = staticmethod(_plain_new)


def is_routing_installed() -> bool:
    new = DataParallelPPOActor.__dict__.get("__new__")
    return getattr(getattr(new, "__func__", new), _ROUTER_FLAG, False)
