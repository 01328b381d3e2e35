"""The zorro step on megatron-core's ``GPTModel``: run a model on a plan, return response log-probs / entropy
(docs/design/model-step.md for the transformers step it mirrors, megatron.md).

One step:

1. the packed row ``plan.input_ids [T]`` (padded to a multiple of the tensor-parallel size under sequence
   parallelism) runs as one ``[1, Tp]`` batch with ``packed_seq_params`` a :class:`ZorroPackedSeqParams` carrying the
   plan to every layer's zorro core attention (:mod:`.attention`);
2. RoPE: megatron's plain ``rope`` ignores ``position_ids`` (positions are the row index). For the call the model's
   ``rotary_pos_emb`` returns its table indexed by the plan's positions, ``[Tp, 1, 1, D]``, so every token is rotated
   by its position in its ordinary row (megatron's unfused sbhd RoPE applies freqs row by row); multi-latent
   attention layers (:class:`~zorro_verl.integrations.megatron.attention.ZorroMLA`) do the same with their own
   table, at ``ZorroPackedSeqParams.position_ids``;
3. the LM head runs only at the response-predicting rows, through ``GPTModel.forward(output_processor=...)``
   (megatron-core >= 0.19; feature-detected, older versions get the model's ``output_layer`` wrapped for the call):
   the post-norm hidden states (all-gathered first under sequence parallelism) are selected at ``plan.logit_index``
   (``plan.head_index`` for prefix trees) and given to the model's own ``output_layer``;
4. log-probs / entropy: with TP = 1 the project's code on ``[N, V]`` (:func:`~zorro_verl.logprob.logits_logprobs`);
   with TP > 1 on each rank's vocabulary slice ``[N, V/tp]`` without gathering it
   (:func:`~zorro_verl.integrations.megatron.vocab_parallel.vocab_parallel_logprobs`);
5. every zorro core attention of the stage must have run exactly once (else ``ValueError``: a layer bypassed zorro);
6. MoE routers: their statistics over the micro-batch's tokens (load-balancing and z losses, expert-bias counts)
   count each packed token by the ordinary tokens it stands for, for the call (:mod:`.moe`).

A value model (verl's Megatron critic: the head a per-token ``Linear(H, 1)``) runs steps 1, 2, 5 and 6 alike; its
head runs at every packed row as megatron's own call does, and the values of the response-predicting rows are picked
(:func:`zorro_gpt_values`).
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.multi_latent_attention import MultiLatentAttention

from zorro_verl.attention.context_parallel import gather_cp_rows
from zorro_verl.integrations.megatron.attention import (
    PositionedRope,
    ZorroMLA,
    ZorroPackedSeqParams,
    zorro_attention_modules,
)
from zorro_verl.integrations.megatron.gdn import GatedDeltaNet, ZorroGatedDeltaNet
from zorro_verl.integrations.megatron.moe import (
    TokenWeightedRouters,
    check_moe_statistics,
    moe_routers,
    token_multiplicity,
)
from zorro_verl.integrations.megatron.vlm import VlmCall, find_vlm_model, vlm_unsupported
from zorro_verl.integrations.megatron.vocab_parallel import vocab_parallel_logprobs
from zorro_verl.logprob import (
    DEFAULT_CHUNK,
    LEAN_BLOCKS,
    check_logits_optimization,
    check_temperature_op,
    logits_logprobs,
)
from zorro_verl.packing import ZorroPlan
from zorro_verl.packing.context_parallel import CPShard, cp_shard
from zorro_verl.packing.multimodal import PackedMedia

__all__ = ["zorro_gpt_step", "zorro_gpt_forward", "zorro_gpt_logprobs", "zorro_gpt_values", "padded_length",
           "find_gpt_model", "has_output_processor", "check_zorro_gpt", "check_value_head", "stochastic_unsupported"]


def has_output_processor() -> bool:
    """Whether this megatron-core's ``GPTModel.forward`` takes ``output_processor`` (0.19 on; 0.16 does not)."""
    return "output_processor" in inspect.signature(GPTModel.forward).parameters


def find_gpt_model(model: torch.nn.Module) -> GPTModel:
    """The ``GPTModel`` inside ``model`` (itself, or under megatron's ``.module`` wrappers: DDP, Float16Module; of a
    vision-language model zorro runs, :mod:`.vlm`, its ``language_model``)."""
    m = model
    for _ in range(8):
        if isinstance(m, GPTModel):
            return m
        vlm = find_vlm_model(m)
        if vlm is not None and isinstance(getattr(vlm, "language_model", None), GPTModel):
            return vlm.language_model
        m = getattr(m, "module", None)
        if m is None:
            break
    raise ValueError(f"model: expected a megatron-core GPTModel or a wrapper with .module chains to one, got "
                     f"{type(model).__name__}.")


def check_zorro_gpt(model: torch.nn.Module, *, require_installed: bool = True) -> None:
    """``ValueError`` naming the setting when zorro cannot run ``model`` (a ``GPTModel`` or a wrapper) exactly:
    other position embeddings, MLA settings zorro has not checked (fused MLA RoPE, ...), multi-token prediction,
    router replay, context parallelism, fp8 / fp4, MoE statistics over the micro-batch's tokens that zorro does not
    count by multiplicity (:mod:`.moe`), a megatron-core without ``output_processor``; with ``require_installed``
    also no zorro core attention (or an MLA layer that is not a ``ZorroMLA``) in it."""
    gpt = find_gpt_model(model)
    vlm = find_vlm_model(model)
    if vlm is not None:
        reason = vlm_unsupported(vlm)
        if reason is not None:
            raise ValueError(f"model: {reason}.")
    _check_model(gpt, len(zorro_attention_modules(gpt)) if require_installed else None, mrope=vlm is not None)


def stochastic_unsupported(cfg) -> Optional[str]:
    """Why a megatron ``TransformerConfig`` cannot train exactly with zorro, or None: the per-token random ops of
    megatron's layers in training. A deduplicated prompt token is one row of the packed sequence where the ordinary
    batch has ``n`` copies: it would draw one dropout mask (one jitter sample) instead of ``n``, and the micro-batch's
    random stream would be consumed differently. Exact (and applied) only in evaluation mode, where they are off."""
    for name, what in (("hidden_dropout", "dropout on the embeddings and after attention / MLP (bias-dropout-add)"),
                       ("attention_dropout", "dropout on the attention probabilities")):
        v = getattr(cfg, name, 0.0) or 0.0
        if v > 0:
            return (f"{name}={v} in training ({what}): a deduplicated prompt token would draw one dropout mask "
                    f"instead of one per copy; set {name}=0 (e.g. override_transformer_config.{name}=0.0; RL "
                    "training runs without dropout)")
    eps = getattr(cfg, "moe_input_jitter_eps", None)
    if eps:
        return (f"moe_input_jitter_eps={eps} in training (the MoE router's per-token multiplicative noise): a "
                "deduplicated prompt token would draw one sample instead of one per copy; set "
                "moe_input_jitter_eps=None")
    return None


def _check_model(gpt: GPTModel, n_layers: Optional[int], mrope: bool = False) -> set:
    """The checks of :func:`check_zorro_gpt`; returns the MoE statistics to count by multiplicity
    (:func:`~zorro_verl.integrations.megatron.moe.check_moe_statistics`). ``mrope``: ``gpt`` is the language model
    of a vision-language model zorro runs (:mod:`.vlm`): 3-D rotary positions, given by the packed row's media."""
    cfg = gpt.config
    if n_layers == 0:
        raise ValueError("model: no zorro core attention found. Build the model with zorro_layer_spec(spec) or call "
                         "install_zorro_megatron(model) first.")
    _check_mixers(gpt, installed=n_layers is not None)
    expected = "mrope" if mrope else "rope"
    if gpt.position_embedding_type != expected:
        raise ValueError(f"position_embedding_type: expected {expected!r} with zorro"
                         f"{' in a vision-language model' if mrope else ''}, got {gpt.position_embedding_type!r} "
                         "(yarn / learned positions are not wired yet; 3-D 'mrope' positions run in Megatron-Bridge's "
                         "Qwen25VLModel only).")
    _check_mla(gpt, cfg, installed=n_layers is not None)
    if getattr(cfg, "mtp_num_layers", None):
        raise ValueError(f"mtp_num_layers: expected 0/None with zorro, got {cfg.mtp_num_layers}: megatron's "
                         "multi-token prediction layers roll the input ids, positions and hidden states one token "
                         "along the row (cu_seqlens segments at best); on zorro's packed row a response's next token "
                         "is not its neighbour (sibling responses follow one prompt) and the MTP loss counts "
                         "prompt tokens once. Set mtp_num_layers=None (verl: model.mtp.enable=False) or run without "
                         "zorro.")
    if getattr(cfg, "context_parallel_size", 1) != 1 and getattr(cfg, "multi_latent_attention", False):
        raise ValueError(f"context_parallel_size: expected 1 with zorro on multi_latent_attention, got "
                         f"{cfg.context_parallel_size} (MLA positions its RoPE inside its projections; not wired to "
                         "zorro's CP layout yet). Set context_parallel_size=1.")
    for name in ("fp8", "fp4"):
        if getattr(cfg, name, None):
            raise ValueError(f"{name}: expected None with zorro, got {getattr(cfg, name)!r}: low-precision scaling "
                             "statistics (amax) are taken over the micro-batch's tokens, which deduplication changes. "
                             f"Set {name}=None.")
    if getattr(cfg, "num_moe_experts", None) and getattr(cfg, "moe_enable_routing_replay", False):
        # decided on the config (a stage may hold no router): replay is set up for every MoE layer of the model
        raise ValueError("moe_enable_routing_replay: got True on an MoE model; with zorro it must be False: replayed "
                         "routes are set per token of the ordinary rows, and zorro's step does not hand them to the "
                         "packed row's routers (a deduplicated prompt token would replay its group's first row's "
                         "routes, checked equal across the group by zorro_verl.packing.routes.packed_routes). Set "
                         "moe_enable_routing_replay=False (verl: router_replay.mode=disabled) or run without zorro.")
    return check_moe_statistics(gpt)


def _check_mixers(gpt: GPTModel, installed: bool) -> None:
    """Every layer's sequence mixer is one zorro runs on the packed row: self-attention, multi-latent attention or a
    gated delta-net (with ``installed``, the gated delta-nets zorro's: an ordinary one would run its recurrence
    across the packed row's segments, uncounted by the step's layer-call check)."""
    known = (SelfAttention, MultiLatentAttention, IdentityOp) + ((GatedDeltaNet,) if GatedDeltaNet else ())
    for i, layer in enumerate(getattr(getattr(gpt, "decoder", None), "layers", None) or ()):
        mixer = getattr(layer, "self_attention", None)
        if mixer is None:
            continue
        if not isinstance(mixer, known):
            raise ValueError(f"decoder.layers[{i}].self_attention: a {type(mixer).__name__}, a sequence mixer zorro "
                             "does not run on the packed row (zorro runs self-attention, multi-latent attention "
                             "and megatron's GatedDeltaNet); it would mix the packed row's segments. Run this model "
                             "without zorro.")
        if installed and GatedDeltaNet is not None and isinstance(mixer, GatedDeltaNet) \
                and not isinstance(mixer, ZorroGatedDeltaNet):
            raise ValueError(f"decoder.layers[{i}].self_attention: a gated delta-net without zorro's packed "
                             "recurrence; build the model with zorro_layer_spec(spec) or call "
                             "install_zorro_megatron(model).")


def _check_mla(gpt: GPTModel, cfg, installed: bool) -> None:
    """Multi-latent attention is exact with zorro on megatron's unfused RoPE (each :class:`ZorroMLA` layer looks its
    own table up at the plan's positions inside its projections); the settings that bypass that table are refused."""
    if not getattr(cfg, "multi_latent_attention", False):
        return
    plain = [type(m).__name__ for m in gpt.modules()
             if installed and isinstance(m, MultiLatentAttention) and not isinstance(m, ZorroMLA)]
    if plain:
        raise ValueError(f"multi_latent_attention: {len(plain)} MLA layer(s) ({plain[0]}) without zorro's RoPE "
                         "positions; build the model with zorro_layer_spec(spec) or call "
                         "install_zorro_megatron(model).")
    if cfg.apply_rope_fusion:
        raise ValueError("apply_rope_fusion: expected False with zorro on multi_latent_attention, got True: "
                         "megatron's fused MLA RoPE kernels (fused_apply_mla_rope_for_q / _kv) take cos / sin by the "
                         "token's index in its sequence (or cu_seqlens), not by its position in its ordinary row, "
                         "and are not checked with zorro. Set apply_rope_fusion=False (the unfused MLA RoPE is "
                         "exact).")
    if cfg.rotary_interleaved:
        raise ValueError("rotary_interleaved: expected False with zorro on multi_latent_attention, got True (MLA "
                         "hands the packed row as [tokens, heads, dim], which megatron's interleaved rotate-half "
                         "does not index). Set rotary_interleaved=False.")
    for name in ("cache_mla_latents", "mla_down_proj_fusion"):
        if getattr(cfg, name, False):
            raise ValueError(f"{name}: expected False with zorro on multi_latent_attention, got True (an inference "
                             "cache / Transformer Engine's fused down projection, not checked with zorro). Set "
                             f"{name}=False.")


def _cp_shard(gpt: GPTModel, plan: ZorroPlan) -> Optional[CPShard]:
    """This rank's :class:`~zorro_verl.packing.context_parallel.CPShard` of ``plan`` under context parallelism
    (memoised on the plan: every stage and the loss read the same one), else None. Under sequence parallelism the
    slice length is a multiple of the TP size."""
    cfg = gpt.config
    cp = getattr(cfg, "context_parallel_size", 1)
    if cp == 1:
        return None
    from megatron.core import parallel_state

    rank = parallel_state.get_context_parallel_rank()
    multiple = cfg.tensor_model_parallel_size if cfg.sequence_parallel else 1
    return plan.memo.get(("megatron_cp", cp, rank, multiple), lambda: cp_shard(
        plan, cp, rank, group=parallel_state.get_context_parallel_group(), multiple=multiple))


def _model_rope(gpt: GPTModel, positions: torch.Tensor):
    """The model's RoPE table at the plan's positions for one forward (:class:`PositionedRope`); under multi-latent
    attention the model has none: each zorro MLA layer positions its own table inside its projections
    (:class:`~zorro_verl.integrations.megatron.attention.ZorroMLA`), also when megatron recomputes them."""
    if getattr(gpt.config, "multi_latent_attention", False):
        return contextlib.nullcontext()
    return PositionedRope(gpt.rotary_pos_emb, positions,
                          whole_table=getattr(gpt.config, "context_parallel_size", 1) > 1)


def _head_rows(hidden_states: torch.Tensor, output_layer, output_weight, keep: torch.Tensor, call) -> torch.Tensor:
    """The LM head at the kept rows: ``hidden_states [Tp(/tp under SP), 1, H]`` -> logits ``[Nh, 1, V/tp]``.
    ``call(x, weight=, runtime_gather_output=)`` runs the head layer (the layer itself, or its class's ``forward``
    from inside a wrap of the instance's)."""
    if not output_layer.sequence_parallel:
        return call(hidden_states[keep], weight=output_weight, runtime_gather_output=False)[0]
    # Sequence parallel: the rows are spread over the TP ranks. Gather them (backward: each rank keeps its slice of
    # the gradient, which the head's own input all-reduce below has made complete), pick the kept rows and run the
    # head as a plain column-parallel layer, as megatron's inference path does.
    full = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False,
                                                group=output_layer.tp_group)
    output_layer.sequence_parallel = False
    try:
        return call(full[keep], weight=output_weight, runtime_gather_output=False)[0]
    finally:
        output_layer.sequence_parallel = True


class _RowsOutputLayer:
    """For one forward on a megatron-core without ``output_processor``: the model's ``output_layer`` (an instance
    attribute over its class's ``forward``, removed on exit) computes the logits of the kept rows only."""

    def __init__(self, gpt: GPTModel, keep: torch.Tensor):
        self.layer = gpt.output_layer if gpt.post_process else None
        self.keep = keep

    def __enter__(self):
        layer, keep = self.layer, self.keep
        if layer is None:  # a stage without the head
            return self
        if "forward" in vars(layer):
            raise ValueError("output_layer.forward: already replaced on this instance; run one zorro step at a time.")
        call = type(layer).forward.__get__(layer)

        def forward(input_, weight=None, runtime_gather_output=None, **_):
            return _head_rows(input_, layer, weight, keep, call), None

        layer.forward = forward
        return self

    def __exit__(self, *exc):
        if self.layer is not None:
            del self.layer.forward
        return False


def _check_head_args(temperature, logits_optimization: str, temperature_op: str) -> tuple[str, str]:
    mode = check_logits_optimization(logits_optimization)
    op = check_temperature_op(temperature_op)
    if mode == "memory":
        raise ValueError("logits_optimization: 'memory' is not supported on megatron yet (its head is vocabulary "
                         "parallel); use 'none' or 'compute'.")
    if isinstance(temperature, torch.Tensor) or isinstance(temperature, bool) \
            or not isinstance(temperature, (int, float)) or temperature <= 0:
        raise ValueError(f"temperature: expected a float > 0, got {temperature!r} (per-row tensors are not wired "
                         "to the megatron step yet).")
    return mode, op


def padded_length(model: torch.nn.Module, plan: ZorroPlan) -> int:
    """Tokens of the row the model runs for ``plan``: ``plan.T``, rounded up to a multiple of the tensor-parallel
    size under sequence parallelism (the pipeline schedule's ``seq_length`` for a zorro micro-batch)."""
    gpt = find_gpt_model(model)
    cfg = gpt.config
    shard = _cp_shard(gpt, plan)
    if shard is not None:  # context parallelism: this rank's slice (a multiple of TP under SP)
        return shard.local_len
    tp = cfg.tensor_model_parallel_size
    return plan.T if not cfg.sequence_parallel else -(-plan.T // tp) * tp


def check_value_head(model: torch.nn.Module) -> None:
    """``ValueError`` unless the ``GPTModel`` in ``model`` (its last pipeline stage; other stages have no head) ends
    in a per-token value head as verl's Megatron critic builds it: ``output_layer`` a ``torch.nn.Linear`` with one
    output (Megatron-Bridge's / mbridge's ``LinearForLastLayer``, ``Linear(H, 1)`` whose forward casts to fp32 and,
    under sequence parallelism, all-gathers its ``[T/tp, 1, 1]`` output)."""
    gpt = find_gpt_model(model)
    if not gpt.post_process:
        return
    head = getattr(gpt, "output_layer", None)
    if not isinstance(head, torch.nn.Linear) or head.out_features != 1:
        found = (type(head).__name__ if not isinstance(head, torch.nn.Linear)
                 else f"{type(head).__name__}(out_features={head.out_features})")
        raise ValueError(f"value model: expected a GPTModel whose output_layer is a per-token value head (a "
                         f"torch.nn.Linear with out_features=1, as verl's Megatron critic builds it: "
                         f"LinearForLastLayer), got output_layer={found}. Build the critic with verl's value-model "
                         "hook (model_type=value_model) or disable zorro for the critic.")


def zorro_gpt_forward(model: torch.nn.Module, plan: ZorroPlan, *, backend: str = "sdpa",
                      value_head: bool = False, media: Optional[PackedMedia] = None) -> torch.Tensor:
    """Run this pipeline stage of a zorro ``GPTModel`` on ``plan`` (inside megatron's pipeline schedule, a stage
    after the first receives its input through ``set_input_tensor`` as usual).

    Returns the stage's output: on the last stage the head's logits at the response-predicting rows
    ``[Nh, 1, V/tp]`` (``Nh = N``, or the distinct rows of a prefix tree), for :func:`zorro_gpt_logprobs`; on other
    stages the hidden states ``[Tp(/tp under SP), 1, H]`` that the schedule sends on (``Tp``: :func:`padded_length`).
    ``value_head``: the model is a value model (:func:`check_value_head`, verl's Megatron critic); its last stage
    returns the values at the response-predicting rows ``[Nh, 1, 1]`` (fp32, as the head casts) for
    :func:`zorro_gpt_values`. Every TP rank and every stage (every model chunk under virtual pipeline stages) calls
    with the same plan. A model in training mode with per-token random ops is refused
    (:func:`stochastic_unsupported`).

    ``media``: for a vision-language model (Megatron-Bridge's ``Qwen25VLModel``, :mod:`.vlm`; required there,
    refused otherwise) the packed row's media and 3-D positions, from a plan built on the media's keyed ids
    (:func:`~zorro_verl.packing.multimodal.build_media_plan`): the model's own forward runs the vision tower on
    ``media``'s images (each unique one once), scatters the features and runs the language model at
    ``media.position_ids [3, 1, T]``."""
    gpt = find_gpt_model(model)
    vlm = find_vlm_model(model)
    layers = zorro_attention_modules(gpt)
    if (vlm is None) != (media is None):
        want = ("the packed row's PackedMedia (build_media_plan) for a vision-language model" if vlm is not None
                else "None for a text model")
        raise ValueError(f"media: expected {want} ({type(vlm if vlm is not None else gpt).__name__}), got "
                         f"{type(media).__name__ if media is not None else None}.")
    if vlm is not None:
        reason = vlm_unsupported(vlm)
        if reason is not None:
            raise ValueError(f"model: {reason}.")
        if value_head:
            raise ValueError("value_head: a vision-language value model is not wired to zorro's Megatron step; run "
                             "the critic without zorro.")
    moe_stats = _check_model(gpt, len(layers), mrope=vlm is not None)
    if value_head:
        check_value_head(gpt)
    reason = stochastic_unsupported(gpt.config) if gpt.training else None
    if reason is not None:
        raise ValueError(f"zorro: {reason}.")
    # sequence parallelism scatters the row over the TP ranks: its length must divide; the pad tokens form no
    # segment of the plan (the core attention outputs 0 there) and are never read by the head
    Tp = padded_length(gpt, plan)
    shard = _cp_shard(gpt, plan)
    if shard is not None:  # context parallelism: this rank's zigzag share of the packed row
        if moe_stats:
            raise ValueError(f"context_parallel_size: got {gpt.config.context_parallel_size} with MoE router "
                             f"statistics on ({sorted(moe_stats)}); zorro's per-token multiplicities are not wired "
                             "to the CP layout yet. Turn the statistics off (verl's "
                             "moe_router_load_balancing_type='none') or set context_parallel_size=1.")
        pad, ids = 0, shard.input_ids
        keep = shard.logit_index if shard.head_index is None else shard.head_index
    else:
        pad = Tp - plan.T
        ids = plan.input_ids if not pad else torch.cat([plan.input_ids, plan.input_ids.new_zeros(pad)])
        keep = plan.logit_index if plan.head_index is None else plan.head_index
    zp = (ZorroPackedSeqParams.for_plan(plan, backend, Tp) if shard is None
          else ZorroPackedSeqParams.for_plan(plan, backend, Tp, cp=shard))
    pos = zp.position_ids  # [Tp], 0 on the pad tokens
    # MoE statistics over the micro-batch's tokens (load-balancing / z losses, expert-bias counts): each packed token
    # counts as the ordinary tokens it stands for (pad tokens: 0)
    routers = contextlib.nullcontext()
    if moe_stats:
        w = token_multiplicity(plan)
        w = w if not pad else torch.cat([w, w.new_zeros(pad)])
        routers = TokenWeightedRouters(moe_routers(gpt), w, plan.ordinary_tokens, bool(gpt.config.sequence_parallel))

    if value_head:
        # The value head runs at every packed row, as megatron's own head call ([Tp, H] x [H, 1]: negligible), then
        # the kept rows are picked: under sequence parallelism the head then sees exactly the stock call's inputs
        # (each rank its sequence shard, the output all-gathered by the head, the weight's gradient the rank's
        # shard's part, summed over TP by megatron's finalize_model_grads as for every sequence-parallel weight)
        def head(hidden_states, output_layer, output_weight, scale_logits, runtime_gather_output=None, **_):
            values = output_layer(hidden_states, weight=output_weight, runtime_gather_output=runtime_gather_output)[0]
            return scale_logits(values)[keep]  # [Tp, 1, 1] -> [Nh, 1, 1]

        rows = contextlib.nullcontext()
    else:
        def head(hidden_states, output_layer, output_weight, scale_logits, **_):  # hidden_states [Tp(/tp), 1, H]
            return scale_logits(_head_rows(hidden_states, output_layer, output_weight, keep, output_layer))

        rows = _RowsOutputLayer(gpt, keep)
    if vlm is not None:
        # the model's own forward on the packed row: its embedding, the tower on the packed media, its merge; the
        # 3-D positions and zorro's params / head handed to its language model for the call (.vlm.VlmCall)
        positions = media.position_ids.to(ids.device)
        if positions.shape != (3, 1, plan.T):
            raise ValueError(f"media.position_ids: expected [3, 1, {plan.T}] for this plan, got "
                             f"{tuple(positions.shape)}; pack the media of this plan (pack_media).")
        if pad:
            positions = torch.cat([positions, positions.new_zeros(3, 1, pad)], dim=-1)
        processor = head if has_output_processor() else None
        call = VlmCall(vlm, positions, zp, processor)
        with call, routers, (rows if processor is None else contextlib.nullcontext()):
            out = model(input_ids=ids[None], attention_mask=None, **media.model_kwargs())
        if call.rope_calls != 1:
            raise ValueError(f"get_rope_index: expected one call by the vision-language model's forward, got "
                             f"{call.rope_calls}; this model's forward is not the one zorro's step was checked with.")
        if processor is None:
            out = out.transpose(0, 1)
    elif has_output_processor():
        with _model_rope(gpt, pos), routers:
            out = model(input_ids=ids[None], position_ids=pos[None], attention_mask=None, packed_seq_params=zp,
                        output_processor=head)
    else:
        # megatron-core < 0.19: no output_processor; the model's own head call runs on the kept rows (its output,
        # [1, Nh, V/tp] after megatron's [s b h] -> [b s h] transpose, is turned back); a value head on every row
        # ([1, Tp, 1]), whose kept rows are picked after
        with _model_rope(gpt, pos), rows, routers:
            out = model(input_ids=ids[None], position_ids=pos[None], attention_mask=None, packed_seq_params=zp)
        if gpt.post_process:
            out = out.transpose(0, 1)
            if value_head:
                out = out[keep]
    if zp.calls.count != len(layers):
        raise ValueError(f"zorro core attention: expected {len(layers)} calls (one per layer of this stage), got "
                         f"{zp.calls.count}; a layer bypassed zorro and attended over the whole packed row.")
    return out


def zorro_gpt_values(model: torch.nn.Module, plan: ZorroPlan, values: torch.Tensor) -> torch.Tensor:
    """The values of the plan's response-predicting positions (the last prompt token and every response token but
    the last: where verl reads a critic's values) from the last stage's output of
    ``zorro_gpt_forward(..., value_head=True)``, ``values [Nh, 1, 1]`` -> ``[N]``, original row order (a prefix
    tree's shared rows expanded per output), identical on every TP rank; ``plan.to_padded`` gives ``[B, R]``. Under
    context parallelism ``values`` holds this rank's rows (``[Nh_s, 1, 1]``), gathered back to ``[N]`` on every CP
    rank (backward: this rank's rows only, as :func:`zorro_gpt_logprobs`)."""
    gpt = find_gpt_model(model)
    shard = _cp_shard(gpt, plan)
    src = plan if shard is None else shard  # under CP: this rank's rows, gathered back to [N] below
    keep = src.logit_index if src.head_index is None else src.head_index
    if not gpt.post_process or values.dim() != 3 or values.shape != (keep.numel(), 1, 1):
        raise ValueError(f"values: expected the last stage's value-head output [{keep.numel()}, 1, 1], got "
                         f"{tuple(values.shape)}. Pass what zorro_gpt_forward(..., value_head=True) returned on the "
                         "last pipeline stage.")
    out = values[:, 0, 0]
    out = out if src.head_inverse is None else out[src.head_inverse]
    return out if shard is None else gather_cp_rows(out, shard)


def zorro_gpt_logprobs(model: torch.nn.Module, plan: ZorroPlan, logits: torch.Tensor, *, temperature: float = 1.0,
                       calculate_entropy: bool = False, logits_optimization: str = "none",
                       chunk_size: int = DEFAULT_CHUNK,
                       temperature_op: str = "upcast") -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs (and entropy) of the plan's response tokens from the last stage's output of
    :func:`zorro_gpt_forward`, ``logits [Nh, 1, V/tp]`` -> ``(log_probs [N], entropy [N] | None)``, original row
    order, identical on every TP rank (arguments as :func:`zorro_gpt_step`)."""
    mode, op = _check_head_args(temperature, logits_optimization, temperature_op)
    gpt = find_gpt_model(model)
    shard = _cp_shard(gpt, plan)
    src = plan if shard is None else shard  # under CP: this rank's head rows, gathered back to [N] below
    keep = src.logit_index if src.head_index is None else src.head_index
    if logits.dim() != 3 or logits.shape[:2] != (keep.numel(), 1):
        raise ValueError(f"logits: expected the last stage's head output [{keep.numel()}, 1, V/tp], got "
                         f"{tuple(logits.shape)}. Pass what zorro_gpt_forward returned on the last pipeline stage.")
    index = src.head_inverse
    if gpt.config.tensor_model_parallel_size == 1:
        lp, ent = logits_logprobs(logits[:, 0], src.target_ids, temperature=float(temperature),
                                  calculate_entropy=calculate_entropy, logits_optimization=mode,
                                  chunk_size=chunk_size, index=index, temperature_op=op)
    else:
        # the rank's vocabulary slice; a prefix tree's shared rows are expanded per output here (autograd sums
        # them back)
        logits = logits[:, 0] if index is None else logits[index, 0]
        group = gpt.output_layer.tp_group
        lp, ent = vocab_parallel_logprobs(logits, src.target_ids, group=group,
                                          vocab_start=dist.get_rank(group) * logits.shape[1],
                                          temperature=float(temperature), calculate_entropy=calculate_entropy,
                                          chunk_size=max(1, min(chunk_size, -(-logits.shape[0] // LEAN_BLOCKS))),
                                          temperature_op=op)
    if shard is None:
        return lp, ent
    return gather_cp_rows(lp, shard), (gather_cp_rows(ent, shard) if ent is not None else None)


def zorro_gpt_step(model: torch.nn.Module, plan: ZorroPlan, *, backend: str = "sdpa", temperature: float = 1.0,
                   calculate_entropy: bool = False, logits_optimization: str = "none",
                   chunk_size: int = DEFAULT_CHUNK, temperature_op: str = "upcast",
                   media: Optional[PackedMedia] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Deduplicated forward of ``plan`` on a megatron-core ``GPTModel`` held by one pipeline stage: log-probs (and
    entropy) of every valid response token, original row order — what
    :func:`~zorro_verl.integrations.transformers.zorro_step` returns for a transformers model. Under pipeline
    parallelism run :func:`zorro_gpt_forward` in megatron's schedule and :func:`zorro_gpt_logprobs` in its loss.

    Args:
        model: a ``GPTModel`` (or megatron's wrappers around one) built with :func:`zorro_layer_spec` or after
            :func:`install_zorro_megatron`; tensor parallelism with or without sequence parallelism. Every TP rank
            calls with the same plan.
        plan: the micro-batch's plan (:func:`~zorro_verl.packing.build_plan`, prompt or prefix sharing).
        backend: a registered attention backend name (:data:`~zorro_verl.attention.BACKEND_NAMES`).
        temperature: a float > 0, applied as ``temperature_op`` says (:data:`~zorro_verl.logprob.TEMPERATURE_OPS`).
        calculate_entropy: also compute the entropy.
        logits_optimization: ``none`` or ``compute`` (``memory``, the chunked head, is not wired to megatron's
            vocabulary-parallel head yet: refused).
        chunk_size: rows per block of the log-prob computation (at most ``ceil(rows / LEAN_BLOCKS)``).
        temperature_op: where the temperature divides (:data:`~zorro_verl.logprob.TEMPERATURE_OPS`).
        media: a vision-language model's packed media and 3-D positions (:func:`zorro_gpt_forward`).

    Returns:
        ``(log_probs [N], entropy [N] | None)`` in the logits' precision (fp32, fp64 for fp64 models), identical on
        every TP rank; ``plan.to_padded`` gives ``[B, R]``.
    """
    _check_head_args(temperature, logits_optimization, temperature_op)
    gpt = find_gpt_model(model)
    if not (gpt.pre_process and gpt.post_process):
        raise ValueError("pipeline_model_parallel_size: zorro_gpt_step runs a whole model, but this stage has "
                         f"pre_process={gpt.pre_process}, post_process={gpt.post_process}. Under pipeline "
                         "parallelism call zorro_gpt_forward in megatron's schedule and zorro_gpt_logprobs in its "
                         "loss function.")
    logits = zorro_gpt_forward(model, plan, backend=backend, media=media)
    return zorro_gpt_logprobs(model, plan, logits, temperature=temperature, calculate_entropy=calculate_entropy,
                              logits_optimization=logits_optimization, chunk_size=chunk_size,
                              temperature_op=temperature_op)
