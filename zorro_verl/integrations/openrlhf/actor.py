"""zorro's forward for OpenRLHF's ``openrlhf.models.actor.Actor`` (docs/design/openrlhf.md).

:func:`install` replaces ``Actor.forward`` on the class (so every instance — the policy in training and in the
old-log-prob pass, the reference model, the EMA copy — runs it, and DeepSpeed's ``isinstance(model, Actor)``
checks still hold) with :func:`zorro_forward`, which keeps ``Actor.forward``'s signature and return contract:

* ``action_log_probs [B, A]`` fp32, already multiplied by ``action_mask`` (as stock);
* with ``return_output=True``, ``(action_log_probs, output)`` where ``output.entropy [B, T - 1]`` fp32 (with
  ``return_entropy``) equals stock at every position that predicts a response token and is 0 elsewhere (OpenRLHF
  reads it only under ``action_mask``). The output holds no logits (zorro computes the head at response-predicting
  rows only); ``output.aux_loss`` (MoE load-balancing) raises, since its ordinary value counts each prompt n times.

LoRA actors (``--ds.lora.rank``: ``Actor.model`` is a ``PeftModel``) run the same forward (docs/design/model-step.md,
"LoRA (PEFT) models"). Calls zorro cannot run exactly (ring attention, multimodal inputs / VLMs, LoRA dropout > 0,
DeepSpeed tensor parallelism, calls without ``action_mask`` that want full logits or per-token log-probs) raise, or with
``on_unsupported=warn`` run the stock forward, warn once per reason and count the call in ``zorro/fallback_batches``.
Packed (``packing_samples``) and padded actors run the same deduplicated step: the plan is the packing.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Optional

import torch

from zorro_verl.integrations.openrlhf.layout import plan_from_openrlhf, scatter_actions, scatter_entropy
from zorro_verl.integrations.openrlhf.settings import FIX_HINT, settings_from_env
from zorro_verl.integrations.transformers import install_zorro, is_installed, uninstall_zorro, zorro_step
from zorro_verl.integrations.transformers.lora import lora_unsupported
from zorro_verl.integrations.verl.common import ZorroActorMixin, dedup_metrics, setup_unsupported
from zorro_verl.integrations.verl.settings import ZorroSettings

__all__ = ["install", "uninstall", "zorro_forward", "ZorroActorState", "ZorroActorOutput", "actor_state",
           "pop_metrics", "pop_counts", "COUNT_KEYS", "hf_model", "args_unsupported", "check_args",
           "with_zorro_metrics", "with_trainer_metrics", "install_model_actor_counts", "group_counts"]

logger = logging.getLogger(__name__)


def hf_model(module: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside ``Actor.model``: unwraps wrappers that hold it as their ``module`` child
    (DeepSpeed's engine, which also has a ``config`` of its own: its DeepSpeed config)."""
    from transformers import PreTrainedModel

    m = module
    while not isinstance(m, PreTrainedModel) and isinstance(m._modules.get("module"), torch.nn.Module):
        m = m._modules["module"]
    return m


class _EngineCall:
    """What :func:`zorro_step` runs: calls go through ``Actor.model`` (a DeepSpeed engine's forward and hooks run as
    in the stock call), attribute reads (``config``, ``get_output_embeddings``, ``get_decoder``...) go to the
    Hugging Face model inside (the engine's own ``config`` is its DeepSpeed config)."""

    def __init__(self, outer: torch.nn.Module, inner: torch.nn.Module):
        self._outer, self._inner = outer, inner

    def __call__(self, *args, **kwargs):
        return self._outer(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _tensor_parallel(model: torch.nn.Module) -> bool:
    """DeepSpeed AutoTP replaces linear layers with its own classes (``deepspeed.module_inject``)."""
    return any(type(m).__module__.startswith("deepspeed.module_inject") for m in model.modules())


class ZorroActorState(ZorroActorMixin):
    """zorro's per-``Actor`` state: settings, the static refusal, the backend and the metric counters."""

    zorro_fix_hint = FIX_HINT

    def __init__(self, actor, settings: ZorroSettings):
        self._actor_model = actor.model
        self._is_vlm = bool(getattr(actor, "is_vlm", False))
        model = hf_model(actor.model)
        device = next(model.parameters()).device.type
        self._zorro_setup(settings, device)
        self.counts = {"ordinary_tokens": 0, "dedup_tokens": 0, "fallback_batches": 0, "calls": 0}
        logger.warning("zorro: OpenRLHF actor forward active (%s; backend=%s, logits=%s, on_unsupported=%s)",
                       "deduplicated forward" if self._zorro_static_reason is None
                       else f"stock forward: {self._zorro_static_reason}", self._zorro_backend,
                       settings.logits_optimization, settings.on_unsupported)

    def _zorro_static_unsupported(self) -> Optional[str]:
        model = hf_model(self._actor_model)
        reason = setup_unsupported(hf_config=model.config) or lora_unsupported(model)
        if reason is not None:
            return reason
        if self._is_vlm:
            return "vision-language models (3-D position ids / multimodal inputs)"
        if _tensor_parallel(model):
            return "DeepSpeed tensor parallelism (--ds.tensor_parallel_size > 1): heads and vocabulary are sharded"
        return None

    def metrics(self, reset: bool = True) -> dict:
        """``zorro/*`` metrics since the last call (:data:`~zorro_verl.integrations.verl.common.METRIC_KEYS`)."""
        c = self.counts
        out = dedup_metrics(c["ordinary_tokens"], c["dedup_tokens"], 0, c["fallback_batches"])
        if reset:
            self.counts = dict.fromkeys(c, 0)
        return out


def actor_state(actor, settings: Optional[ZorroSettings] = None) -> ZorroActorState:
    """The actor's :class:`ZorroActorState`, created on first use from ``settings`` (default: the environment)."""
    state = actor.__dict__.get("_zorro_state")
    if state is None:
        state = ZorroActorState(actor, settings if settings is not None else settings_from_env())
        actor.__dict__["_zorro_state"] = state
    return state


def pop_metrics(actor) -> dict:
    """The actor's ``zorro/*`` metrics since the last call (empty if zorro never ran on it)."""
    state = getattr(actor, "__dict__", {}).get("_zorro_state")
    return {} if state is None else state.metrics()


#: The raw counters summed over ranks and models before the ``zorro/*`` ratios are formed.
COUNT_KEYS = ("ordinary_tokens", "dedup_tokens", "fallback_batches")


def pop_counts(actor) -> dict:
    """The actor's raw counters (:data:`COUNT_KEYS`, ints) since the last call, then reset; zeros if zorro never
    ran on it (or ``actor`` is None)."""
    state = getattr(actor, "__dict__", {}).get("_zorro_state")
    if state is None:
        return dict.fromkeys(COUNT_KEYS, 0)
    out = {k: state.counts[k] for k in COUNT_KEYS}
    state.counts = dict.fromkeys(state.counts, 0)
    return out


class ZorroActorOutput:
    """``return_output`` of :func:`zorro_forward`: ``entropy [B, T - 1]`` fp32 (with ``return_entropy``).

    ``logits`` and ``aux_loss`` raise with the reason: zorro computes the head only at response-predicting rows, and
    the MoE load-balancing loss of the ordinary forward weights each prompt n times.
    """

    def __init__(self, entropy: Optional[torch.Tensor], moe: bool):
        self.entropy = entropy
        self._moe = moe

    def __getattr__(self, name):
        if name == "aux_loss" and self.__dict__.get("_moe"):
            raise ValueError("zorro: output.aux_loss (the MoE load-balancing loss) is not produced by the "
                             "deduplicated forward: the ordinary one counts every prompt once per sample. Set "
                             f"--actor.aux_loss_coef 0, or {FIX_HINT}.")
        if name == "logits":
            raise AttributeError("zorro: the deduplicated forward computes the LM head at response-predicting rows "
                                 "only and returns no logits; call Actor.forward with an action_mask.")
        raise AttributeError(name)

    def __getitem__(self, key):
        return getattr(self, key)


def _call_unsupported(actor, action_mask, ring_attn_group, mm_inputs) -> Optional[str]:
    if ring_attn_group is not None:
        return "ring attention (--ds.ring_attn_size > 1): sequences are sliced across ranks"
    if mm_inputs:
        return "multimodal inputs"
    if action_mask is None:
        return "a call without action_mask (full logits or per-token log-probs, e.g. SFT/DPO)"
    return None


@contextmanager
def _stock_attention(model):
    """The model's own attention for a fallback call (zorro's is restored after)."""
    if not is_installed(model):
        yield
        return
    uninstall_zorro(model)
    try:
        yield
    finally:
        install_zorro(model, probe=False)


def zorro_forward(self, sequences, action_mask=None, attention_mask=None, return_output=False,
                  allgather_logits=False, return_logprobs=False, ring_attn_group=None, packed_seq_lens=None,
                  return_entropy=False, **mm_inputs):
    """``Actor.forward`` with zorro's deduplicated step (same signature and return contract).

    Args:
        sequences: ``[B, T] int64`` prompt + response ids; attention_mask: ``[B, T]`` (1 on each row's span);
        action_mask: ``[B, A]`` (column ``j`` marks token ``T - A + j``); the rest as in OpenRLHF.

    Returns:
        ``action_log_probs [B, A]`` fp32 (masked), or ``(action_log_probs, ZorroActorOutput)`` with
        ``return_output``.
    """
    stock = type(self)._zorro_stock_forward
    state = actor_state(self)
    if not state.zorro.enable:
        return stock(self, sequences, action_mask, attention_mask, return_output, allgather_logits,
                     return_logprobs, ring_attn_group, packed_seq_lens, return_entropy, **mm_inputs)
    model = hf_model(self.model)
    reason = state._zorro_static_reason or _call_unsupported(self, action_mask, ring_attn_group, mm_inputs)
    if reason is not None:
        if state._zorro_static_reason is None:
            state._zorro_unsupported(reason)
        state.counts["fallback_batches"] += 1
        with _stock_attention(model):
            return stock(self, sequences, action_mask, attention_mask, return_output, allgather_logits,
                         return_logprobs, ring_attn_group, packed_seq_lens, return_entropy, **mm_inputs)
    if return_entropy and not return_output:
        raise ValueError("return_entropy=True needs return_output=True (as in OpenRLHF's Actor.forward).")
    if attention_mask is None:
        attention_mask = torch.ones_like(sequences)
    install_zorro(model, probe=False)  # idempotent; every step checks that each layer ran through zorro
    layout = plan_from_openrlhf(sequences, attention_mask, action_mask)
    runner = model if self.model is model else _EngineCall(self.model, model)
    logp, ent = zorro_step(runner, layout.plan, backend=state._zorro_backend, temperature=float(self.temperature),
                           calculate_entropy=return_entropy, logits_optimization=state.zorro.logits_optimization,
                           chunk_size=state.logits_chunk_size)
    state.counts["calls"] += 1
    state.counts["ordinary_tokens"] += layout.stock_tokens
    state.counts["dedup_tokens"] += layout.plan.T
    action_log_probs = scatter_actions(layout, logp, action_mask)
    if not return_output:
        return action_log_probs
    entropy = scatter_entropy(layout, ent) if return_entropy else None
    moe = bool(getattr(model.config, "output_router_logits", False))
    return action_log_probs, ZorroActorOutput(entropy, moe)


def install(actor_cls) -> None:
    """Replace ``actor_cls.forward`` (OpenRLHF's ``Actor``) with :func:`zorro_forward` (idempotent); the stock
    forward stays reachable as ``actor_cls._zorro_stock_forward``."""
    if actor_cls.__dict__.get("forward") is zorro_forward:
        return
    actor_cls._zorro_stock_forward = actor_cls.__dict__["forward"]
    actor_cls.forward = zorro_forward


def uninstall(actor_cls) -> None:
    """Restore the stock ``forward`` (for tests and for switching zorro off in one process)."""
    stock = actor_cls.__dict__.get("_zorro_stock_forward")
    if stock is not None:
        actor_cls.forward = stock
        del actor_cls._zorro_stock_forward


def args_unsupported(args) -> Optional[str]:
    """Why OpenRLHF's parsed arguments (the ``--group.key`` namespace) rule zorro out, or None."""
    def get(group, key, default=None):
        return getattr(getattr(args, group, None), key, default)

    if (get("ds", "ring_attn_size", 1) or 1) > 1:
        return "ring attention (--ds.ring_attn_size > 1): sequences are sliced across ranks"
    if (get("ds", "tensor_parallel_size", 1) or 1) > 1:
        return "DeepSpeed tensor parallelism (--ds.tensor_parallel_size > 1): heads and vocabulary are sharded"
    lora = get("ds", "lora")
    if (getattr(lora, "rank", 0) or 0) > 0 and (getattr(lora, "dropout", 0) or 0) > 0:
        return (f"LoRA dropout > 0 (--ds.lora.dropout {lora.dropout}): the ordinary forward draws one dropout mask "
                "per sample, zorro computes each shared prompt once, so the two would train different functions; "
                "set --ds.lora.dropout 0")
    if (get("actor", "aux_loss_coef", 0) or 0) > 0:
        return ("the MoE load-balancing loss (--actor.aux_loss_coef > 0): the ordinary one counts every prompt once "
                "per sample")
    return None


def check_args(args, settings: ZorroSettings) -> None:
    """The start-up check (the trainer actor, when OpenRLHF builds its experience maker): raise, or warn once
    (``on_unsupported=warn``; the workers then run the stock forward for the affected calls, counted)."""
    if not settings.enable:
        return
    if settings.group_balance:
        from zorro_verl.integrations.openrlhf.batching import warn_micro_batch_sizes

        warn_micro_batch_sizes(args)
    reason = args_unsupported(args)
    if reason is not None:
        from zorro_verl.integrations.verl.common import report_unsupported

        report_unsupported(settings, reason, set(), logger, FIX_HINT)


def with_zorro_metrics(ppo_train):
    """Wrap ``ActorPPOTrainer.ppo_train`` (every policy rank runs it): its returned status (logged by OpenRLHF) gains
    the ``zorro/*`` metrics of the policy's forward passes since the last step (old log-probs and training), summed
    over all its ranks (``strategy.all_reduce``), and ``zorro/split_groups`` (groups its training micro-batches
    cut, all ranks)."""

    def wrapped(self, *args, **kwargs):
        from zorro_verl.integrations.openrlhf.batching import pop_split_counts

        status = ppo_train(self, *args, **kwargs)
        if not settings_from_env().enable:
            return status
        counts = pop_counts(self.actor)
        counts["split_groups"] = pop_split_counts()["train"]
        # a collective: every rank gets here with the same keys (the switch is the same on all of them)
        total = self.strategy.all_reduce({k: float(v) for k, v in counts.items()}, op="sum")
        status.update(dedup_metrics(total["ordinary_tokens"], total["dedup_tokens"], total["split_groups"],
                                    total["fallback_batches"]))
        return status

    wrapped.__wrapped__ = ppo_train
    return wrapped


def install_model_actor_counts(base_model_actor) -> None:
    """Give OpenRLHF's ``BaseModelActor`` (the Ray actors holding a model: reference, reward) a ``zorro_counts``
    method, reached through its ``execute_batch(method_name, ...)``: the raw counters of its ``self.model``
    (:func:`pop_counts`; zeros when that model is not an ``Actor`` zorro ran on)."""

    def zorro_counts(self, probe=None):
        return pop_counts(getattr(self, "model", None))

    base_model_actor.zorro_counts = zorro_counts


def group_counts(group) -> dict:
    """The counters of every Ray actor of an OpenRLHF ``RayActorGroup`` (e.g. the reference model's), summed."""
    import ray

    try:
        results = ray.get(group.async_run_method("execute_batch", "zorro_counts", {"probe": [None]}, 0, 1))
    except AttributeError as e:  # Ray's task error derives from the worker's exception class
        raise RuntimeError("zorro: a Ray actor of the reference model has no zorro_counts: its process did not run "
                           "zorro's OpenRLHF loader, so it runs OpenRLHF's stock forward. Pass ZORRO_OPENRLHF=1 to "
                           "the job's runtime env and install the loader (zorro-verl openrlhf install) in the "
                           "workers' environment.") from e
    total = dict.fromkeys(COUNT_KEYS, 0)
    for result in results:
        for k in COUNT_KEYS:
            total[k] += result[0][k]
    return total


def with_trainer_metrics(train_step):
    """Wrap ``BasePPOTrainer.train_step`` (the trainer actor, where experiences are made and balanced): its status
    gains ``zorro/experience_split_groups`` (groups cut by the experience maker's micro-batches and, with dynamic
    batching, by the DP balancing) and the reference model's ``zorro/ref_dedup_ratio``,
    ``zorro/ref_prompt_tokens_saved`` and ``zorro/ref_fallback_batches`` (all its ranks)."""

    def wrapped(self, *args, **kwargs):
        from zorro_verl.integrations.openrlhf.batching import pop_split_counts

        status, global_step = train_step(self, *args, **kwargs)
        if not settings_from_env().enable:
            return status, global_step
        maker = self.experience_maker
        split = getattr(maker, "zorro_split_groups", 0) + pop_split_counts()["balance"]
        maker.zorro_split_groups = 0
        status["zorro/experience_split_groups"] = float(split)
        ref = getattr(self, "reference_model_group", None)
        if ref is not None:
            c = group_counts(ref)
            m = dedup_metrics(c["ordinary_tokens"], c["dedup_tokens"], 0, c["fallback_batches"])
            status["zorro/ref_dedup_ratio"] = m["zorro/dedup_ratio"]
            status["zorro/ref_prompt_tokens_saved"] = m["zorro/prompt_tokens_saved"]
            status["zorro/ref_fallback_batches"] = m["zorro/fallback_batches"]
        return status, global_step

    wrapped.__wrapped__ = train_step
    return wrapped
