"""The zorro Megatron engine for verl >= 0.9: ``MegatronEngineWithLMHead`` with a deduplicated micro-batch forward
(docs/design/megatron.md "The Megatron engine").

Data path (one ``forward_backward_batch`` call = one mini-batch of this DP rank; every TP / PP rank of the DP rank
holds the same batch)::

    jagged batch (input_ids = [prompt | response] per row, no padding)
      -> group-aware micro-batches (fixed rows or a token budget counting each prompt once), the same count on every
         rank (all-reduce MAX, then split), as the FSDP engine (:mod:`.batching`)
      -> megatron's schedule (pipeline or not) over them; per micro-batch and stage, :meth:`zorro_forward_step`:
         build_plan (every TP rank and PP stage builds the same plan from the same rows) -> zorro_gpt_forward (one
         packed row, the plan in the layers' zorro core attention, per-token RoPE positions, the LM head at the
         response-predicting rows; a stage before the last returns its hidden states, which the schedule sends on:
         verl runs it with variable sequence lengths, so the deduplicated length travels) -> on the last stage
         zorro_gpt_logprobs (vocabulary-parallel under TP) -> verl's nested predict-next layout
      -> verl's ``postprocess_micro_batch_func`` unchanged (its loss, the ``num_micro_batch`` scaling), outputs back in
         original row order.

Virtual pipeline stages (``self.module`` a list of model chunks, megatron's interleaved schedule): one iterator over
the same micro-batches per chunk, each chunk's forward on the micro-batch's plan (built once per stage), the head on
the last chunk of the last stage. ``use_fused_kernels=True``: verl's fused head (its Triton linear-cross-entropy at
every row) is not used by a zorro micro-batch; zorro's own head at the response-predicting rows replaces it (the
memory point of the fused kernel), and the stock fallback keeps verl's fused path.

Static context parallelism (``context_parallel_size > 1``): every CP rank of a DP rank builds the same plan and runs
its zigzag share of the packed row (:func:`zorro_gpt_forward`; keys / values exchanged in the core attention), the
log-probs gathered back to every CP rank, verl's loss on the whole micro-batch on each; megatron's schedule and
finalize then reduce the gradients over DP x CP as for the stock engine. In megatron's per-token loss regime
(``calculate_per_token_loss``) the count each CP rank reports is its exact share of the micro-batch's ordinary
tokens (:func:`_cp_token_share`; docs/design/megatron.md "The Megatron engine under context parallelism").

Vision-language models (Megatron-Bridge's ``Qwen25VLModel``, one rank per model: TP = PP = CP = 1): a micro-batch's
plan groups rows on their tokens and images (keyed ids), the rows' 3-D positions come from the model's own
``get_rope_index`` as in the stock forward (which ignores the batch's ``position_ids``), and the model's forward runs
on the packed row with each unique image once (:mod:`zorro_verl.integrations.megatron.vlm`; docs/design/megatron.md
"Vision-language models").

With ``zorro.enable = false`` (or a stock ``McoreEngineConfig``) every method is the stock one. Settings zorro cannot
run exactly are refused at engine start (dynamic context parallelism,
multi-token prediction, router replay, LoRA dropout, vision-language models other than Qwen2.5-VL on one rank per
model, Mamba hybrids; when the model is built, MoE
router statistics zorro does not count by multiplicity — sequence-level aux loss, token dropping, ... —, MoE models
under CP, MoE router losses in the per-token loss regime, MLA settings zorro has not checked (fused MLA RoPE, CP) and
per-token random ops in training: dropout, MoE input jitter), or with ``on_unsupported = warn`` run the stock
forward, warn once and count the batch in ``zorro/fallback_batches`` (the zorro core attention delegates every call
without a zorro plan to the layer's own). Every per-batch check that can fail on one rank (layout, positions,
temperatures) runs before the ranks agree.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Optional

import torch
from megatron.core import parallel_state as mpu
from megatron.core.pipeline_parallel import get_forward_backward_func
from verl.utils import tensordict_utils as tu
from verl.utils.device import get_device_id, get_device_name
from verl.utils.seqlen_balancing import restore_dynamic_batch
from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead
from verl.workers.engine.utils import postprocess_batch_func

from zorro_verl.integrations.megatron import (
    find_gpt_model,
    install_zorro_megatron,
    zorro_gpt_forward,
    zorro_gpt_logprobs,
)
from zorro_verl.integrations.megatron.moe import check_moe_statistics
from zorro_verl.integrations.megatron.step import check_zorro_gpt, stochastic_unsupported
from zorro_verl.integrations.megatron.vlm import find_vlm_model, vlm_unsupported
from zorro_verl.integrations.transformers.vision import media_tokens, rope_positions
from zorro_verl.integrations.verl.common import ZorroActorMixin
from zorro_verl.integrations.verl.settings import settings_of
from zorro_verl.integrations.verl.v09.batching import (
    ZorroBatchingMixin,
    _row_media,
    _standard_positions,
    common_batch_unsupported,
    micro_batch_plan,
    predict_next_outputs,
)
from zorro_verl.integrations.verl.v09.megatron_checks import megatron_setup_unsupported
from zorro_verl.packing.multimodal import batch_media

__all__ = ["ZorroMegatronEngineWithLMHead", "MEGATRON_FIX_HINT"]

logger = logging.getLogger(__name__)

#: the MoE router statistics that are losses (normalised by a token count; refused in the per-token regime)
_ROUTER_LOSSES = frozenset({"aux_loss", "global_aux_loss", "z_loss"})

#: How a user of verl's Megatron engine switches zorro off or to ``warn`` (quoted in refusals).
MEGATRON_FIX_HINT = ("disable zorro (actor_rollout_ref.actor.megatron.zorro.enable=false, and the ref's), or set "
                     "megatron.zorro.on_unsupported=warn to run the stock forward for such batches")


class ZorroMegatronEngineWithLMHead(ZorroBatchingMixin, ZorroActorMixin, MegatronEngineWithLMHead):
    """verl's Megatron LM engine with zorro's deduplicated forward (see module docstring)."""

    #: Marks the engines verl must build when zorro is enabled (checked by the config at start).
    zorro_engine = True
    zorro_fix_hint = MEGATRON_FIX_HINT
    #: The model ends in a value head (the critic's engine, :mod:`.megatron_value_engine`), not the LM head.
    _zorro_value_model = False

    def __init__(self, model_config, engine_config, optimizer_config, checkpoint_config, **kwargs):
        super().__init__(model_config, engine_config, optimizer_config, checkpoint_config, **kwargs)
        self._zorro_setup(settings_of(engine_config), get_device_name())
        if not self.zorro.enable:
            return
        logger.warning("zorro: Megatron engine active (%s; backend=%s, logits=%s, on_unsupported=%s, tp=%d, pp=%d, "
                       "cp=%d)",
                       "deduplicated forward" if self._zorro_static_reason is None
                       else f"stock forward: {self._zorro_static_reason}", self._zorro_backend,
                       self.zorro.logits_optimization, self.zorro.on_unsupported,
                       engine_config.tensor_model_parallel_size, engine_config.pipeline_model_parallel_size,
                       engine_config.context_parallel_size)

    # ------------------------------------------------------------------ support checks
    def _zorro_static_unsupported(self):
        return megatron_setup_unsupported(self.engine_config, self.model_config, self.zorro.logits_optimization)

    def _zorro_model_unsupported(self) -> Optional[str]:
        """Refusals that need the built model: each chunk's ``GPTModel`` (position embedding, MLA, MoE statistics,
        megatron-core's ``output_processor``), MoE models under context parallelism, MoE router losses in megatron's
        per-token loss regime, per-token random ops (dropout, MoE input jitter) on an engine that trains, verl's fused
        forward patched over ``GPTModel.forward``."""
        cp = self.engine_config.context_parallel_size
        vision = getattr(getattr(self.model_config, "hf_config", None), "vision_config", None) is not None
        for chunk in self.module:
            vlm = find_vlm_model(chunk)
            if vision and vlm is None:
                inner = chunk
                while hasattr(inner, "module"):
                    inner = inner.module
                return (f"a vision-language model built as {type(inner).__name__} on the Megatron engine: zorro runs "
                        "Megatron-Bridge's Qwen25VLModel only (Qwen2.5-VL built by verl's default builder, "
                        "vanilla_mbridge=False); run this model without zorro")
            if vlm is not None:
                reason = vlm_unsupported(vlm)
                if reason is None and self._zorro_value_model:
                    reason = ("a vision-language critic (value model) on zorro's Megatron engine: not wired; run the "
                              "critic without zorro")
                if reason is not None:
                    return reason
            gpt = find_gpt_model(chunk)
            try:
                check_zorro_gpt(chunk, require_installed=False)
            except ValueError as e:
                return str(e)
            if cp > 1 and getattr(gpt.config, "num_moe_experts", None):
                # zorro's step refuses CP with router statistics on; without them the routing is token-wise, but
                # megatron's expert dispatch over the CP shards has not been compared with the stock engine
                return (f"MoE models under context parallelism (context_parallel_size={cp}, num_moe_experts="
                        f"{gpt.config.num_moe_experts}): not checked against the stock engine yet; set "
                        "context_parallel_size=1")
            losses = sorted(check_moe_statistics(gpt) & _ROUTER_LOSSES)
            if getattr(gpt.config, "calculate_per_token_loss", False) and losses:
                return (f"calculate_per_token_loss=True with MoE router losses on ({losses}): megatron's per-token "
                        "regime scales the router's losses by the micro-batch's token count and divides every "
                        "gradient by the accumulated count, which zorro has not proved for its multiplicity-weighted "
                        "router statistics; set calculate_per_token_loss=False or turn the router losses off "
                        "(moe_router_load_balancing_type='none', moe_z_loss_coeff=None)")
            # an engine that trains (not forward_only) would run them; a forward-only engine runs in eval mode
            reason = None if self.engine_config.forward_only else stochastic_unsupported(gpt.config)
            if reason is not None:
                return reason
            if self.engine_config.use_fused_kernels and "forward_backup" in vars(gpt):
                # verl's legacy fused path (megatron-core without output_processor) replaces GPTModel.forward
                return ("use_fused_kernels=True with verl's legacy fused forward (GPTModel.forward replaced: this "
                        "megatron-core has no output_processor hook); use megatron-core >= 0.18 or "
                        "use_fused_kernels=False")
        return None

    def _zorro_batch_unsupported(self, data) -> Optional[str]:
        reason = common_batch_unsupported(data)
        if reason is not None:
            return reason
        vlm = self._zorro_vlm()
        if self._zorro_multimodal(data) and vlm is None:
            return "multimodal inputs / 3-D position ids on the Megatron engine with a text-only model"
        if tu.get_non_tensor_data(data=data, key="enable_routing_replay", default=False) \
                or "routed_experts" in data.keys():
            return ("router replay data in the batch (routed_experts / enable_routing_replay): routes recorded per "
                    "token of the ordinary rows are not handed to the packed row's routers yet")
        if not self._zorro_value_model and "temperature" in data.keys() \
                and isinstance(data["temperature"], torch.Tensor):
            t = data["temperature"].reshape(-1)
            if t.numel() > 1 and not bool((t == t[0]).all()):
                return "per-sample temperatures on the Megatron engine (zorro's Megatron head takes one float)"
        # checked here, before the ranks agree: the plan build would raise on one rank, inside the schedule
        # a vision-language model computes its own 3-D positions from the ids and grids (the stock forward ignores
        # the batch's), and so does zorro (_zorro_rows_positions)
        if vlm is None and "position_ids" in data.keys() and not _standard_positions(data["position_ids"]):
            return ("position_ids that do not count 0, 1, 2, ... along each row (verl's text layout): zorro recomputes "
                    "the positions on its packed row, so other positions would change results")
        for chunk in self.module:  # a model put in training mode with per-token random ops (a forward-only engine)
            gpt = find_gpt_model(chunk)
            reason = stochastic_unsupported(gpt.config) if gpt.training else None
            if reason is not None:
                return reason
        return None

    # ------------------------------------------------------------------ vision-language models
    def _zorro_vlm(self):
        """The vision-language model zorro runs (Megatron-Bridge's ``Qwen25VLModel``) of this engine, else None."""
        return find_vlm_model(self.module[0]) if getattr(self, "module", None) else None

    def _zorro_media(self, data, ids_pad, am, rw):
        """A vision-language model's :class:`~zorro_verl.packing.multimodal.BatchMedia` of ``data`` (every batch,
        also one without images: the packed row's 3-D positions come with it), else the text engine's None."""
        vlm = self._zorro_vlm()
        if vlm is None:
            return None if not self._zorro_multimodal(data) else super()._zorro_media(data, ids_pad, am, rw)
        return batch_media(ids_pad, am, rw, _row_media(data), media_tokens(vlm),
                           memo=getattr(self, "_zorro_media_memo", None))

    def _zorro_rows_positions(self, data, ids_pad, am, row=None, col=None):
        """A vision-language model's rows' 3-D positions ``[3, B, S] int64`` as its own forward computes them
        (transformers' ``get_rope_index`` on each row's valid ids and its images' grids; the stock engine ignores
        the batch's ``position_ids``): ``ids_pad [B, S]`` the real ids, ``am [B, S]`` their valid mask."""
        vlm = self._zorro_vlm()
        if vlm is None:
            return super()._zorro_rows_positions(data, ids_pad, am, row, col)
        return rope_positions(vlm, ids_pad, am, _row_media(data))

    # ------------------------------------------------------------------ model
    def initialize(self):
        super().initialize()
        if not self.zorro_active:
            return
        reason = self._zorro_model_unsupported()
        if reason is not None:
            self._zorro_static_reason = reason
            self._zorro_unsupported(reason)
            return
        for chunk in self.module:  # a class swap per core attention: calls without a zorro plan run the stock one
            install_zorro_megatron(chunk)

    # ------------------------------------------------------------------ batch
    def _zorro_sp_size(self) -> int:
        """The CP ranks hold the same batch and split its sequence: a dynamic micro-batch's token budget is the
        per-GPU budget times the CP size (verl's ``sp_size``)."""
        return self.engine_config.context_parallel_size

    def _zorro_per_token_loss(self) -> bool:
        """Whether megatron runs its per-token loss regime (``calculate_per_token_loss``: the loss function returns
        ``(loss_sum, num_tokens, output)`` and ``finalize_model_grads`` divides every gradient by the summed count)."""
        return bool(getattr(find_gpt_model(self.module[0]).config, "calculate_per_token_loss", False))

    def _zorro_loss_normalisers(self, data, sp_size: int) -> None:
        """The stock engine's normalisers (``sp_size``, ``batch_num_tokens``, ``dp_size``) and, in the per-token
        regime, its ``routed_num_tokens``: the ordinary rows' tokens all-reduced over the DP group (verl's
        ``postprocess_micro_batch_func`` scales each micro-batch's loss by it)."""
        super()._zorro_loss_normalisers(data, sp_size)
        if self._zorro_per_token_loss():
            routed = self._routed_num_tokens(data).to(get_device_id())
            torch.distributed.all_reduce(routed, op=torch.distributed.ReduceOp.SUM,
                                         group=self.get_data_parallel_group())
            tu.assign_non_tensor(data, routed_num_tokens=routed.item())

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        if not self.zorro.enable:
            return super().forward_backward_batch(data, loss_function, forward_only=forward_only)
        reason, local, hooks_missing = self._zorro_decide(data, loss_function)
        last_stage = mpu.is_pipeline_last_stage(ignore_virtual=True)
        if reason is not None:
            if self._zorro_static_reason is None:
                self._zorro_unsupported(reason)
            out = super().forward_backward_batch(data, loss_function, forward_only=forward_only)
            if last_stage:
                self._add_metrics(out, {"zorro/fallback_batches": 1.0, **hooks_missing})
            return out

        self._zorro_loss_normalisers(data, self.engine_config.context_parallel_size)  # as the stock engine

        # virtual pipeline stages: megatron's interleaved schedule runs the micro-batches in groups of
        # microbatch_group_size_per_vp_stage (the count a multiple of it, as verl's num_batches_divided_by)
        vpp = mpu.get_virtual_pipeline_model_parallel_world_size()
        group = self.tf_config.microbatch_group_size_per_vp_stage if vpp is not None and vpp > 1 else 1
        mbs = self.zorro_micro_batches(data, local, multiple_of=group)
        micro_batches = [tu.index_select_tensor_dict(data, idx) for idx in mbs.batches]
        n = len(micro_batches)
        for mb in micro_batches:
            tu.assign_non_tensor(mb, num_micro_batch=n)
        tu.assign_non_tensor(data, num_micro_batch=n)
        self._zorro_tree_stats = [0, 0]  # prefix sharing: tokens run by the plans, deepest tree

        postprocess = partial(self.postprocess_micro_batch_func, forward_only=forward_only,
                              loss_function=loss_function)
        # one iterator per model chunk (a list under virtual pipeline stages, as verl's make_batch_generator): every
        # chunk runs every micro-batch; the chunks of this stage share each micro-batch's plan (built once)
        chunks = len(self.module)
        self._zorro_plans = {}
        data_iterator = [iter(micro_batches) for _ in range(chunks)] if chunks > 1 else iter(micro_batches)
        try:
            losses_reduced = get_forward_backward_func()(
                forward_step_func=partial(self.zorro_forward_step, postprocess_micro_batch_func=postprocess),
                data_iterator=data_iterator, model=self.module, num_microbatches=n,
                seq_length=1, micro_batch_size=1,  # verl: shapes travel through p2p (variable_seq_lengths)
                forward_only=forward_only)
        finally:
            self._zorro_plans = None
        if not last_stage:
            self.zorro_last_micro_batches = mbs  # (the last stage's metrics record it too)
            return {}
        out = postprocess_batch_func(output_lst=losses_reduced, indices=mbs.batches, data=data)
        if not tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=True):
            # verl restores the order only for dynamic bsz; group-aware fixed micro-batches reorder rows too
            out["model_output"] = {k: restore_dynamic_batch(v, mbs.batches) for k, v in out["model_output"].items()}
        self._zorro_batch_metrics(out, data, mbs, hooks_missing)
        return out

    # ------------------------------------------------------------------ micro-batch
    def zorro_forward_step(self, batch_iter, model, postprocess_micro_batch_func):
        """Megatron's ``forward_step_func`` for a zorro micro-batch: ``(output, loss_func)``. ``output`` is this
        stage's hidden states, or on the last stage verl's model output (nested predict-next ``log_probs`` /
        ``entropy``); ``loss_func`` is verl's ``postprocess_micro_batch_func`` bound to the micro-batch."""
        mb = next(batch_iter)
        plans = getattr(self, "_zorro_plans", None)
        memo = None if plans is None else plans.get(id(mb))
        if memo is None:
            batch = mb.to(get_device_id())
            vlm = self._zorro_vlm() is not None
            plan, media, p = micro_batch_plan(batch, self.zorro.plan_kwargs(),
                                              self._zorro_media if vlm else None,
                                              self._zorro_rows_positions if vlm else None)
            self._zorro_count_plan(plan)
            memo = [batch, plan, p, 0, media]  # device batch, plan, prompt lengths, chunks that ran it, VLM media
            if plans is not None and len(self.module) > 1:
                plans[id(mb)] = memo
        batch, plan, p = memo[:3]
        media = memo[4]
        memo[3] += 1
        if plans is not None and memo[3] == len(self.module):  # the stage's last chunk has run it
            plans.pop(id(mb), None)
        out = zorro_gpt_forward(model, plan, backend=self._zorro_backend, value_head=self._zorro_value_model,
                                media=media)
        loss_func = partial(postprocess_micro_batch_func, data=batch)
        if self.engine_config.context_parallel_size > 1 and self._zorro_per_token_loss():
            loss_func = partial(_cp_token_share, loss_func, int(self._routed_num_tokens(batch)))
        if not find_gpt_model(model).post_process:
            return out, loss_func
        return self._zorro_model_output(model, batch, plan, p, out), loss_func

    def _zorro_model_output(self, model, batch, plan, p, out):
        """The last stage's model output for verl's ``postprocess_micro_batch_func`` from the head output ``out`` of
        :func:`zorro_gpt_forward`: nested predict-next ``log_probs`` (and ``entropy``)."""
        temperature = batch["temperature"]
        if isinstance(temperature, torch.Tensor):  # one value (checked per batch)
            temperature = temperature.reshape(-1)[0]
        calculate_entropy = tu.get_non_tensor_data(batch, key="calculate_entropy", default=False)
        logp, ent = zorro_gpt_logprobs(model, plan, out, temperature=float(temperature),
                                       calculate_entropy=calculate_entropy,
                                       logits_optimization=self.zorro.logits_optimization,
                                       chunk_size=self.logits_chunk_size)
        return predict_next_outputs(batch, p, plan, logp, ent if calculate_entropy else None)



def _cp_token_share(loss_func, n_tokens: int, output):
    """verl's per-token loss function under static CP, with this CP rank's exact share of the micro-batch's
    ``n_tokens`` ordinary tokens as the count megatron accumulates: ``n // cp``, plus one on the first ``n % cp``
    ranks, so the CP group's shares sum to ``n`` and ``finalize_model_grads``' divisor is the DP group's routed token
    count that verl scales every loss by (verl's own share, ``n // cp`` on every rank, falls short by ``n % cp`` per
    micro-batch and scales every gradient by ``routed / divisor``). ``output``: the micro-batch's model output;
    returns ``(loss_sum, num_tokens int32, output)`` as verl's."""
    out = loss_func(output)
    if len(out) != 3:  # forward only (no loss function): verl's 2-tuple
        return out
    loss_sum, _, result = out
    cp, rank = mpu.get_context_parallel_world_size(), mpu.get_context_parallel_rank()
    share = n_tokens // cp + (1 if rank < n_tokens % cp else 0)
    return loss_sum, torch.tensor(share, dtype=torch.int, device=loss_sum.device), result
