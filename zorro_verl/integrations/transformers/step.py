"""The one model step of zorro: run a model on a plan and return response log-probs / entropy
(docs/design/model-step.md).

Every caller — the standalone API (``DeduplicatedActor``), the verl 0.9 engine, the verl 0.7 actor, the demo and the
benchmark — runs the deduplicated forward through :func:`zorro_step`, so a new capability is added here once.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch

from zorro_verl.attention.ulysses import gather_rows
from zorro_verl.integrations.transformers.context import LayerCalls, StepContext
from zorro_verl.integrations.transformers.hybrid import text_config
from zorro_verl.integrations.transformers.install import forward_packed
from zorro_verl.logprob import (
    DEFAULT_CHUNK,
    check_logits_optimization,
    check_temperature_op,
    linear_head_params,
    linear_logprobs,
    logits_logprobs,
)
from zorro_verl.packing import ZorroPlan
from zorro_verl.packing.multimodal import PackedMedia
from zorro_verl.packing.ulysses import UlyssesShard

__all__ = ["zorro_step", "zorro_logits", "zorro_values", "value_head", "HeadFn", "head_fn_unsupported", "forward_owner"]

#: ``(hidden [Nh, H], head module, targets [N] int64, temperature, calculate_entropy, index [N] int64 | None) ->
#: (log_probs [N], entropy [N] | None)``; ``index`` None: ``Nh = N``, row ``i`` predicts ``targets[i]``
HeadFn = Callable[[torch.Tensor, torch.nn.Module, torch.Tensor, float, bool, Optional[torch.Tensor]],
                  tuple[torch.Tensor, Optional[torch.Tensor]]]


def _per_row_temperature(temperature: torch.Tensor, plan: ZorroPlan, memory: bool):
    """A per-row temperature tensor ``[B]`` (or ``[B, 1]``) -> ``(float, None)`` when all rows have the same one
    (verl's usual case: one float per batch, handed over as a tensor), which then divides each block of logits as
    verl does (``temperature_op="logits_rounded"``, no ``[N, V]`` quotient held), else ``(1.0, divisors [N]
    float32)`` (refused for ``memory``: a head function takes one float); one host sync."""
    t = temperature.reshape(-1).to(torch.float32)
    if t.numel() != plan.B:
        raise ValueError(f"temperature: expected a float or a tensor with one value per row ({plan.B}), got shape "
                         f"{tuple(temperature.shape)}.")
    uniform, first = torch.stack([(t == t[0]).all(), t[0]]).tolist()
    if uniform:
        return first, None
    if memory:
        raise ValueError("temperature: per-row temperatures with logits_optimization='memory' (or a head "
                         "function) are not supported: the head takes one temperature; use 'none' or 'compute'.")
    return 1.0, t[plan.out_row]


def zorro_step(model, plan: ZorroPlan, *, backend: str = "sdpa",
               temperature: Union[float, torch.Tensor] = 1.0, calculate_entropy: bool = False,
               logits_optimization: str = "none", chunk_size: int = DEFAULT_CHUNK,
               calls: Optional[LayerCalls] = None,
               head_fn: Optional[HeadFn] = None,
               shard: Optional[UlyssesShard] = None,
               temperature_op: str = "upcast",
               media: Optional[PackedMedia] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Deduplicated forward of ``plan``: log-probs (and entropy) of every valid response token, original row order.

    Args:
        model: the root ``*ForCausalLM`` (possibly FSDP-wrapped) with zorro installed
            (:func:`~zorro_verl.integrations.transformers.install_zorro`).
        plan: the micro-batch's plan (:func:`~zorro_verl.packing.build_plan`).
        backend: a registered attention backend name (:data:`~zorro_verl.attention.BACKEND_NAMES`).
        temperature: a float > 0 (divides the logits where ``temperature_op`` says), or a per-row tensor ``[B]``
            as verl 0.9's engine passes temperatures (divides the logits in their own dtype by the temperature cast
            to that dtype, verl's ``logits / temperature.to(logits.dtype)``, in every mode; the memory mode needs
            them all equal).
        calculate_entropy: also compute the entropy.
        logits_optimization: ``none | compute | memory`` (:mod:`zorro_verl.logprob`).
        chunk_size: rows per chunk of the ``compute`` / ``memory`` modes.
        calls: an optional :class:`LayerCalls` that receives this forward's layer counts (e.g. fallback kernels).
        head_fn: computes log-probs / entropy from the response-predicting hidden states instead of materialised
            logits (the ``memory`` mode's chunked head by default; e.g. verl's fused kernel):
            ``head_fn(hidden [Nh, H], head module, targets [N] int64, temperature: float, calculate_entropy,
            index [N] int64 | None) -> (log_probs [N], entropy [N] | None)``; ``index`` (prefix-tree plans:
            ``plan.head_inverse``) maps each output to its hidden row, None means one row per output. It runs as the
            head module's forward (see :func:`_head_step`): use the head's parameters (e.g.
            :func:`~zorro_verl.logprob.linear_head_params`), never call the module.
        shard: this rank's part under Ulysses sequence parallelism (:func:`~zorro_verl.packing.ulysses.ulysses_shard`
            of ``plan``; every rank of the SP group calls with the same plan): the model runs on the rank's slice
            of the packed row, the head at the response-predicting rows it holds (a prefix tree's: once per distinct
            local position, ``shard.head_index``), and the outputs are all-gathered (autograd-aware) into ``[N]`` on
            every SP rank. Attention and gated delta-net layers exchange sequence shards for head shards.
        temperature_op: for a float ``temperature``: ``upcast`` (divide after the fp32 upcast, OpenRLHF's order),
            ``logits`` (divide in the logits' dtype, verl 0.7's ``logits.div_(temperature)``) or ``logits_rounded``
            (:data:`~zorro_verl.logprob.TEMPERATURE_OPS`); a tensor ``temperature`` always runs ``logits_rounded``.
            Ignored by a ``head_fn`` (verl's fused kernel applies its own float temperature).
        media: a vision-language model's multimodal batch: the packed row's images / videos and 3-D positions
            (:func:`~zorro_verl.packing.multimodal.build_media_plan`, which also built ``plan``); the model encodes
            each unique prompt's media once inside its own forward.

    Returns:
        ``(log_probs [N], entropy [N] | None)`` — fp32 (fp64 for fp64 models); ``plan.to_padded`` gives ``[B, R]``.
    """
    mode = check_logits_optimization(logits_optimization)
    op = check_temperature_op(temperature_op)
    check_no_per_token_noise(model)
    ctx = StepContext(plan, backend, calls, shard, media)
    divisors = None
    if isinstance(temperature, torch.Tensor):
        temperature, divisors = _per_row_temperature(temperature, plan, memory=mode == "memory" or head_fn is not None)
        op = "logits_rounded"  # verl's op; the divisors below run it as a tensor op, the memory mode as this op
    # the head rows this call computes: all N, or (sequence parallel) the ones whose predicting row this rank holds
    keep, targets = (plan.logit_index, plan.target_ids) if shard is None else (shard.logit_index, shard.target_ids)
    index = None  # prefix trees: the head runs once per distinct position, head_inverse maps outputs to its rows
    if plan.head_index is not None:  # under SP: the distinct positions this rank holds, its outputs' rows there
        keep, index = (plan.head_index, plan.head_inverse) if shard is None else (shard.head_index, shard.head_inverse)
    if divisors is not None and shard is not None:
        divisors = divisors[shard.rows]
    if head_fn is None and mode == "memory":
        head_fn = _chunked_head(chunk_size, op)
    if head_fn is not None:
        logp, ent = _head_step(model, ctx, head_fn, keep, targets, temperature, calculate_entropy, index)
    else:
        logits = forward_packed(model, ctx, logits_to_keep=keep).logits[0]  # [N, Nh or N_s, V]
        if divisors is not None:  # same op and dtype as verl's per-sample temperature scaling
            if index is not None:  # rows sharing a position may have different temperatures: one logit row each
                logits, index = logits[index], None
            logits = logits / divisors.clamp(min=1e-8).to(logits.dtype)[:, None]
        logp, ent = logits_logprobs(logits, targets, temperature=temperature, calculate_entropy=calculate_entropy,
                                    logits_optimization=mode, chunk_size=chunk_size, index=index, temperature_op=op)
    if shard is not None:
        logp = gather_rows(logp, shard)
        ent = None if ent is None else gather_rows(ent, shard)
    return logp, ent


def zorro_logits(model, plan: ZorroPlan, *, backend: str = "sdpa", calls: Optional[LayerCalls] = None,
                 media: Optional[PackedMedia] = None) -> torch.Tensor:
    """Deduplicated forward of ``plan`` returning the raw logits at every response-predicting position (the last
    prompt token and every response token but the last), for callers that need the whole distribution there (verl's
    top-k distillation loss reads the student's logits at the teacher's top-k ids).

    The packed row runs once (each unique prompt once); the head runs at ``plan.logit_index`` only (a prefix tree:
    once per distinct position, ``head_index``, then expanded by ``head_inverse``). No temperature is applied: the
    caller scales the logits as its framework does. No Ulysses sharding (the caller refuses it).

    Returns:
        ``logits [N, V]`` in the model's output dtype, in the plan's output order (row ``i`` predicts
        ``plan.target_ids[i]``).
    """
    check_no_per_token_noise(model)
    ctx = StepContext(plan, backend, calls, None, media)
    keep, index = plan.logit_index, None
    if plan.head_index is not None:
        keep, index = plan.head_index, plan.head_inverse
    logits = forward_packed(model, ctx, logits_to_keep=keep).logits[0]  # [N or Nh, V]
    if index is not None:
        logits = logits[index.to(logits.device)]
    return logits


def value_head(model) -> torch.nn.Linear:
    """The per-token value head of a value model as verl builds it (``AutoModelForTokenClassification`` with
    ``num_labels = 1``: ``score``, a ``Linear(H, 1)`` on the backbone's last hidden state, after a dropout verl sets
    to 0). ``ValueError`` naming what was found for any other layout (e.g. trl's ``v_head`` wrapper, whose forward also
    computes the LM head's logits), or a dropout in training mode (one draw per shared prompt token)."""
    owner = forward_owner(model)
    if hasattr(owner, "v_head"):
        raise ValueError("value model: a trl AutoModelForCausalLMWithValueHead (`v_head`), which verl loads only when "
                         "the checkpoint has no token-classification class; zorro's value step runs "
                         "*ForTokenClassification value models (num_labels=1, head `score`). Use a checkpoint that "
                         "loads as AutoModelForTokenClassification, or disable zorro for the critic.")
    head = forward_owner(getattr(owner, "score", None)) if getattr(owner, "score", None) is not None else None
    if not isinstance(head, torch.nn.Linear) or head.out_features != 1:
        found = (type(head).__name__ if not isinstance(head, torch.nn.Linear)
                 else f"Linear(out_features={head.out_features})")
        raise ValueError(f"value model: expected a *ForTokenClassification model with num_labels=1 (a Linear(H, 1) "
                         f"`score` head), got {type(owner).__name__} with score={found}. Use verl's value-model "
                         "loading (num_labels=1) or disable zorro for the critic.")
    drop = getattr(owner, "dropout", None)
    if owner.training and isinstance(drop, torch.nn.Dropout) and drop.p > 0:
        raise ValueError(f"value model: its classifier dropout is {drop.p} in training mode: a per-token random op, "
                         "which the deduplicated forward would draw once per shared prompt token. Set "
                         "config.classifier_dropout = 0 (verl's critic does), or disable zorro for the critic.")
    return head


def zorro_values(model, plan: ZorroPlan, *, backend: str = "sdpa", calls: Optional[LayerCalls] = None,
                 shard: Optional[UlyssesShard] = None) -> torch.Tensor:
    """Deduplicated forward of a value model (:func:`value_head`): the value at every position whose token predicts
    a response token (``plan.logit_index``: the last prompt token and every response token but the last, the
    positions verl reads a critic's values at), in the plan's output order.

    The packed row runs once through the model (each unique prompt once); its per-token ``Linear(H, 1)`` head runs
    on every packed position (``[T, H] x [H, 1]``, negligible), and the values of the response-predicting positions
    are picked. Under Ulysses (``shard``) each rank picks the ones it holds and they are all-gathered (autograd-aware)
    into ``[N]`` on every SP rank. Prefix-tree plans read each distinct position once (``head_index``) and map the
    outputs to it (``head_inverse``).

    Returns:
        ``values [N]`` in the model's output dtype (fp32 for fp32 models, fp64 for fp64); ``plan.to_padded`` gives
        ``[B, R]``.
    """
    value_head(model)
    check_no_per_token_noise(model)
    ctx = StepContext(plan, backend, calls, shard, None)
    keep = plan.logit_index if shard is None else shard.logit_index
    index = None
    if plan.head_index is not None:
        keep, index = (plan.head_index, plan.head_inverse) if shard is None else (shard.head_index, shard.head_inverse)
    scores = forward_packed(model, ctx).logits[0]  # [T (T_s under SP), 1]
    values = scores[keep.to(scores.device), 0]
    if index is not None:
        values = values[index.to(values.device)]
    if shard is not None:
        values = gather_rows(values, shard)
    return values


#: HF config keys of per-token random ops in training mode (a deduplicated prompt token would draw one sample where
#: the ordinary forward draws one per row): MoE router input jitter and the residual / embedding / hidden dropouts.
#: (Attention dropout and LoRA dropout are refused at install.)
PER_TOKEN_NOISE_KEYS = ("router_jitter_noise", "hidden_dropout", "hidden_dropout_prob", "resid_pdrop", "embd_pdrop",
                        "ffn_dropout", "activation_dropout")


def check_no_per_token_noise(model) -> None:
    """``ValueError`` naming the key when ``model`` is in training mode with a per-token random op on
    (:data:`PER_TOKEN_NOISE_KEYS` > 0 in its text config): zorro would sample it once per shared prompt token
    instead of once per row, a different function than the ordinary forward's. Eval mode runs (no noise)."""
    if not model.training or getattr(model, "config", None) is None:
        return
    cfg = text_config(model)
    for key in PER_TOKEN_NOISE_KEYS:
        v = getattr(cfg, key, 0.0)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
            raise ValueError(f"model: config.{key} = {v} in training mode: a per-token random op, which the "
                             "deduplicated forward would draw once per shared prompt token instead of once per row "
                             f"(a different function than the ordinary forward's). Set config.{key} = 0 for RL "
                             "training with zorro, or run this model without zorro.")


def _chunked_head(chunk_size: int, temperature_op: str = "upcast") -> HeadFn:
    """The ``memory`` mode's head function: the chunked autograd Function over the head's own ``weight`` / ``bias``
    (:func:`~zorro_verl.logprob.linear_logprobs`). It never calls the head module, so under FSDP2 (or FSDP1 with the
    head as its own unit) the head's parameters are gathered once per step (around the swapped head forward) whatever
    the chunk count, and their gradients come back as the Function's outputs through autograd (FSDP's post-backward
    reduction sees them; tested for both). With ``index`` (a prefix tree) the head runs once per distinct position,
    on the ``[Nh, H]`` rows. The temperature divides each chunk's logits as ``temperature_op`` says (in the chunk's
    dtype for ``logits`` / ``logits_rounded``: the dtype ``F.linear`` returns, autocast included)."""

    def head_fn(hidden, head, targets, temperature, calculate_entropy, index):
        weight, bias = linear_head_params(head)
        return linear_logprobs(hidden, weight, bias, targets, temperature=temperature,
                               calculate_entropy=calculate_entropy, chunk_size=chunk_size, index=index,
                               temperature_op=temperature_op)

    return head_fn


def forward_owner(module):
    """The module whose ``forward`` is the model's own, for swapping it for one call: ``module`` itself (plain, or
    FSDP2, whose ``fully_shard`` keeps the class and runs its unshard / reshard as hooks), or the module inside FSDP1
    wrappers (``FullyShardedDataParallel.forward`` unshards the flat parameter, registers the backward hooks, then
    calls the wrapped module's forward; an instance ``forward`` set on the wrapper would skip all that and run on
    sharded or stale parameter views)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    while isinstance(module, FullyShardedDataParallel):
        module = module.module
    return module


def head_fn_unsupported(model):
    """Why head functions (the ``memory`` mode, verl's fused kernels) cannot run on ``model``, or None: they return
    the head's results as the logits, which a model that post-processes its logits would change."""
    cap = getattr(text_config(model), "final_logit_softcapping", None)
    if cap:
        return (f"this model soft-caps its logits after the head (final_logit_softcapping={cap}); the chunked / fused "
                "head paths cannot reproduce that. Use logits_optimization='none' or 'compute'.")
    return None


def _head_step(model, ctx: StepContext, head_fn: HeadFn, keep: torch.Tensor, targets: torch.Tensor,
               temperature: float, calculate_entropy: bool, index: Optional[torch.Tensor] = None):
    """Run ``head_fn`` on the response-predicting hidden states *as the head module's forward* (``keep`` the rows of
    the model's input to compute, ``targets [N]`` the tokens the outputs predict; ``index [N]``: a prefix tree's
    ``head_inverse``, the kept row of each output, handed to ``head_fn`` with the ``[Nh, H]`` distinct rows).

    The root forward runs as usual (FSDP hooks, final norm) and calls its head on ``hidden[:, logit_index]``; the
    head's forward is swapped, for this call only, for one that returns ``head_fn``'s results stacked ``[1, 2, N]``.
    So FSDP gathers the head's parameters once around the whole head computation (whatever it chunks), and its
    backward hooks fire on the returned tensor before the gradient reaches ``head_fn``'s graph. The root must hand
    the head's output through unchanged as ``logits`` (checked, :func:`_handed_through`: the tensor or an identity
    alias of it, as DeepSpeed ZeRO-3's module hooks return): models that post-process logits are refused.
    """
    # FSDP1 may wrap the head as its own unit (a size-based wrap policy): the wrapper's forward gathers the head's
    # parameters and calls the inner module, whose forward is the one swapped (and whose parameters head_fn reads)
    head = forward_owner(model.get_output_embeddings())
    reason = head_fn_unsupported(model)
    if reason is not None:
        raise ValueError(f"logits_optimization: {reason}")
    returned = {}

    def forward(x):  # x: [1, N, H] ([1, Nh, H] for a prefix tree: its distinct positions)
        logp, ent = head_fn(x[0], head, targets, temperature, calculate_entropy, index)
        # a fresh tensor, not a view: FSDP2 registers its pre-backward hook on the module's output
        out = torch.cat([logp[None, None], (ent if ent is not None else torch.zeros_like(logp))[None, None]], 1)
        returned["out"], returned["version"] = out, out._version
        return out

    had_own = "forward" in head.__dict__
    saved = head.__dict__.get("forward")
    head.forward = forward
    try:
        out = forward_packed(model, ctx, logits_to_keep=keep).logits
    finally:
        if had_own:
            head.forward = saved
        else:
            del head.forward
    if not _handed_through(out, returned.get("out"), returned.get("version")):
        raise ValueError("logits_optimization: the model transformed its head's output before returning it as logits "
                         "(e.g. a cast or soft-capping), so the chunked / fused head paths cannot be used with it. Use "
                         "logits_optimization='none' or 'compute'.")
    return out[0, 0], (out[0, 1] if calculate_entropy else None)


def _handed_through(out, ours: Optional[torch.Tensor], version: Optional[int]) -> bool:
    """Whether the root returned the head's output ``ours`` unchanged as ``out``: the tensor itself, or an alias of
    it. DeepSpeed ZeRO-3 hands every module's output (the head's, then the root's) through an identity autograd
    Function (``outputs.detach()`` forward, gradients passed on unchanged) whose backward fetches the module's
    partitioned parameters first; such an alias shares ``ours``' storage, shape, strides and dtype (so its values
    are ours) and, with autograd, its graph reaches ``ours`` through single-input nodes (so its gradient is). A cast,
    soft-capping or any other arithmetic makes new storage and is rejected; done in place (on ``ours`` or an alias,
    which share its version counter) it changes ``ours._version`` from ``version``, recorded when it was made, and is
    rejected too."""
    if ours is None or ours._version != version:
        return False
    if out is ours:
        return True
    if not isinstance(out, torch.Tensor):
        return False
    if (out.data_ptr(), out.shape, out.stride(), out.dtype) != (ours.data_ptr(), ours.shape, ours.stride(), ours.dtype):
        return False
    if ours.grad_fn is None:
        return out.grad_fn is None
    node = out.grad_fn
    for _ in range(16):  # a few identity wrappers per module between the head and the root
        if node is ours.grad_fn:
            return True
        inputs = [] if node is None else [f for f, _ in node.next_functions if f is not None]
        if len(inputs) != 1:
            return False
        node = inputs[0]
    return False

