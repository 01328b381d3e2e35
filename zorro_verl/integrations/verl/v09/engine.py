"""The zorro FSDP engine for verl >= 0.9: ``FSDPEngineWithLMHead`` with a deduplicated micro-batch forward
(docs/design/verl.md).

Data path (one ``forward_backward_batch`` call = one mini-batch of this DP rank)::

    jagged batch (input_ids = [prompt | response] per row, no padding)
      -> group ids from the valid prompt tokens (any row order)
      -> group-aware micro-batches (fixed rows or token budget counting each prompt once), the same count on every
         DP rank (all-reduce MAX, then split)
      -> per micro-batch: build_plan -> zorro_step (one packed row through the FSDP root module, LM head at the
         response-predicting rows only) -> verl's nested predict-next layout
         (row b's slice [p_b - 1, p_b + r_b - 1) holds its response log-probs; other entries are 0 and never read)
      -> verl's loss function unchanged (global token normalisation), outputs back in original row order.

Under Ulysses sequence parallelism (``ulysses_sequence_parallel_size = sp > 1``) every rank of an SP group builds
the same plan from the same batch, runs its slice of the padded packed row, exchanges sequence shards for head
shards around zorro's attention and all-gathers the head's rows (docs/design/verl.md).

With ``zorro.enable = false`` (or a stock ``FSDPEngineConfig``) every method is the stock one. Settings zorro cannot
run exactly raise, or with ``on_unsupported = warn`` run the stock forward for that batch, warn once and count the
batch in ``zorro/fallback_batches``.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager, nullcontext

import torch
from verl.utils import tensordict_utils as tu
from verl.utils.device import get_device_id, get_device_name
from verl.utils.seqlen_balancing import restore_dynamic_batch
from verl.utils.torch_functional import logprobs_from_logits
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
from verl.workers.engine.utils import detach_tree, postprocess_batch_func

from zorro_verl.attention.ulysses import check_ulysses_heads
from zorro_verl.integrations.transformers import install_zorro, is_installed, uninstall_zorro, zorro_step
from zorro_verl.integrations.transformers.hybrid import (
    linear_attention_modules,
    linear_attention_sp_repeat,
    text_config,
)
from zorro_verl.integrations.transformers.lora import lora_unsupported
from zorro_verl.integrations.transformers.mixers import mixers_sp_unsupported
from zorro_verl.integrations.transformers.ssm import mamba_sp_unsupported
from zorro_verl.integrations.transformers.step import forward_owner, head_fn_unsupported, zorro_logits
from zorro_verl.integrations.transformers.vision import is_multimodal
from zorro_verl.integrations.verl.common import ZorroActorMixin, setup_unsupported
from zorro_verl.integrations.verl.settings import settings_of
from zorro_verl.integrations.verl.v09.batching import (
    ZorroBatchingMixin,
    _standard_positions,
    common_batch_unsupported,
    is_sft_batch,
    micro_batch_plan,
    predict_next_index,
    predict_next_outputs,
    row_group_ids,
    row_lengths,
    sft_split,
    sft_unsupported,
    to_predict_next,
)
from zorro_verl.integrations.verl.v09.fused import zorro_fused_step
from zorro_verl.integrations.verl.v09.vlm import restore_verl_methods, run_idle_tower, use_transformers_methods
from zorro_verl.logprob import linear_head_params
from zorro_verl.packing.ulysses import ulysses_shard

__all__ = ["ZorroFSDPEngineWithLMHead", "row_lengths", "row_group_ids"]

logger = logging.getLogger(__name__)


@contextmanager
def _idle_tower(module):
    """For one forward of a micro-batch without images: the input embedding's output gets ``0 * mean`` of the vision
    tower on a dummy image added (:func:`~zorro_verl.integrations.verl.v09.vlm.run_idle_tower`)."""
    owner = next(m for m in module.modules() if hasattr(m, "visual") and hasattr(m, "config"))
    handle = module.get_input_embeddings().register_forward_hook(lambda mod, args, out: run_idle_tower(owner, out))
    try:
        yield
    finally:
        handle.remove()


class ZorroFSDPEngineWithLMHead(ZorroBatchingMixin, ZorroActorMixin, FSDPEngineWithLMHead):
    """verl's FSDP LM engine with zorro's deduplicated forward (see module docstring)."""

    #: Marks the engines verl must build when zorro is enabled (checked by the config at start).
    zorro_engine = True

    def __init__(self, model_config, engine_config, optimizer_config, checkpoint_config):
        super().__init__(model_config, engine_config, optimizer_config, checkpoint_config)
        self._zorro_setup(settings_of(engine_config), get_device_name())
        if not self.zorro.enable:
            return
        logger.warning("zorro: FSDP engine active on rank %d (%s; backend=%s, logits=%s, on_unsupported=%s, "
                       "ulysses_sp=%d)", self.rank, "deduplicated forward" if self._zorro_static_reason is None
                       else f"stock forward: {self._zorro_static_reason}", self._zorro_backend,
                       self.zorro.logits_optimization, self.zorro.on_unsupported,
                       self.engine_config.ulysses_sequence_parallel_size)

    def _zorro_sp_size(self) -> int:
        return self.ulysses_sequence_parallel_size

    # ------------------------------------------------------------------ support checks
    def _zorro_static_unsupported(self):
        mc = self.model_config
        sp = self.engine_config.ulysses_sequence_parallel_size
        qat = getattr(self.engine_config, "qat", None)
        if qat is not None and getattr(qat, "enable", False) and str(getattr(qat, "mode", "")).lower() == "w4a4":
            # W4A16 quantises weights only (token-independent: exact on the packed row); W4A4 also activations, with
            # a global scale observed over each micro-batch's tokens, which deduplication changes
            return ("QAT W4A4 (fsdp_config.qat.mode=w4a4): its activation scale is observed over each micro-batch's "
                    "tokens, which deduplication changes (prompt tokens count once); use mode=w4a16 or disable zorro")
        return setup_unsupported(sp, getattr(mc, "hf_config", None), ulysses_supported=True, vlm_supported=True)

    def _zorro_batch_unsupported(self, data):
        get = tu.get_non_tensor_data
        reason = common_batch_unsupported(data, topk_distillation=True)
        if reason is not None:
            return reason
        if get(data=data, key="distillation_use_topk", default=False) or get(data=data, key="distillation_only",
                                                                             default=False):
            reason = self._topk_distillation_unsupported(data)
            if reason is not None:
                return reason
        if is_sft_batch(data):  # verl's SFT trainer: split each row at its first loss token (batching.sft_split)
            reason = sft_unsupported(data)
            if reason is not None:
                return reason
            sft_split(data)
        if (get(data=data, key="use_fused_kernels", default=False) and "temperature" in data.keys()
                and isinstance(data["temperature"], torch.Tensor)):
            # verl's fused path asserts one float temperature per batch
            return "per-sample temperature tensors with use_fused_kernels=True (verl's fused kernels take one float)"
        if self.zorro.logits_optimization == "memory" and "temperature" in data.keys():
            t = data["temperature"]
            if isinstance(t, torch.Tensor) and t.numel() > 1 and not bool((t == t.reshape(-1)[0]).all()):
                return "per-sample temperatures with logits_optimization=memory"
        if self._zorro_multimodal(data):
            if not is_multimodal(self.module):
                return "multimodal inputs / 3-D position ids with a text-only model"
            if get(data=data, key="use_fused_kernels", default=False):
                return ("multimodal batches with use_fused_kernels=True (zorro's fused head does not pass the "
                        "images to the model)")
            return None  # the positions are checked against every row's own by the plan (packed_positions)
        if "position_ids" in data.keys() and not _standard_positions(data["position_ids"]):
            return ("position_ids that do not count 0, 1, 2, ... along each row (verl's text layout): zorro recomputes "
                    "the positions on its packed row, so other positions would change results")
        return None

    def _topk_distillation_unsupported(self, data):
        """Why this engine cannot run verl's top-k distillation outputs on ``data`` exactly, or None
        (:meth:`_topk_distillation_outputs` covers the plain head on text batches)."""
        get = tu.get_non_tensor_data
        what = None
        if self.ulysses_sequence_parallel_size > 1:
            what = "Ulysses sequence parallelism (verl's top-k loss slices the teacher tensors by its own shard layout)"
        elif get(data=data, key="use_fused_kernels", default=False):
            what = "use_fused_kernels=True (verl's fused FSDP head returns no student logits)"
        elif self.zorro.logits_optimization == "memory":
            what = "logits_optimization=memory (the loss needs the student's logits; use none or compute)"
        elif self._zorro_multimodal(data):
            what = "multimodal batches"
        if what is None:
            return None
        return (f"top-k distillation (distillation_use_topk=True) with {what}: zorro's distillation path runs the "
                "plain LM head on text batches without Ulysses SP; change that setting or disable zorro for the "
                "actor")

    def initialize(self):
        super().initialize()
        self._zorro_stock_attn = getattr(self.module.config, "_attn_implementation", None)
        if self.zorro_active:
            # settings refused once the model exists: at initialisation, never at the first step
            reason = self._zorro_model_unsupported()
            if reason is not None:
                self._zorro_static_reason = reason
                self._zorro_unsupported(reason)
        if self.zorro_active:
            self._install()

    def _zorro_model_unsupported(self):
        """Static refusals that need the built model: LoRA adapters with dropout, attention or gated delta-net head
        counts Ulysses cannot shard, Mamba layers / LFM2 short-conv channels / MiniMax lightning heads Ulysses cannot
        shard; the ``memory`` logits mode computes the head as
        ``F.linear(hidden, weight, bias)`` and needs the head's output returned unchanged as the logits."""
        reason = self._zorro_backbone_unsupported()
        if reason is not None or self.zorro.logits_optimization != "memory":
            return reason
        try:
            linear_head_params(forward_owner(self.module.get_output_embeddings()))
        except ValueError as e:
            return f"logits_optimization=memory with this model's head ({e})"
        reason = head_fn_unsupported(self.module)
        return None if reason is None else f"logits_optimization=memory: {reason}"

    def _zorro_backbone_unsupported(self):
        """The static refusals of the model's body (shared with the value-head engine): LoRA adapters with dropout,
        Mamba layers / LFM2 short-conv channels / MiniMax lightning heads under Ulysses, head counts Ulysses cannot
        shard."""
        reason = lora_unsupported(self.module)
        if reason is not None:
            return reason
        sp = self.ulysses_sequence_parallel_size
        reason = mamba_sp_unsupported(self.module, sp) or mixers_sp_unsupported(self.module, sp)
        if reason is not None:
            return reason
        if sp > 1:
            cfg = text_config(self.module)
            try:
                check_ulysses_heads(cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None)
                                    or cfg.num_attention_heads, sp)
                for _, mod in linear_attention_modules(self.module):  # gated delta-nets exchange their heads too
                    linear_attention_sp_repeat(mod.num_k_heads, mod.num_v_heads, sp)
            except ValueError as e:
                return str(e)
        return None

    def _install(self) -> None:
        # install_zorro's checks (layer types, hybrid delta-net wrappers); every forward then checks that each
        # attention / linear-attention layer ran through zorro once (check_layer_calls).
        install_zorro(self.module, probe=False)
        if is_multimodal(self.module):  # verl's class patches bypass transformers' attention interface (vlm.py)
            use_transformers_methods(self.module)

    def _installed(self) -> bool:
        return is_installed(self.module)

    @contextmanager
    def _stock_attention(self):
        """Run with the model's original attention (fallback batches); covers the backward recompute too."""
        if not self._installed():
            yield
            return
        uninstall_zorro(self.module)
        restore_verl_methods(self.module)
        try:
            yield
        finally:
            self._install()

    # ------------------------------------------------------------------ batch
    def forward_backward_batch(self, data, loss_function, forward_only=False):
        if not self.zorro.enable:
            return super().forward_backward_batch(data, loss_function, forward_only=forward_only)
        reason, local, hooks_missing = self._zorro_decide(data, loss_function)
        if reason is None and self.ulysses_sequence_parallel_size > 1:
            self._check_sp_batches_agree(data)
        if reason is not None:
            if self._zorro_static_reason is None:
                self._zorro_unsupported(reason)
            with self._stock_attention():
                out = super().forward_backward_batch(data, loss_function, forward_only=forward_only)
            self._add_metrics(out, {"zorro/fallback_batches": 1.0, **hooks_missing})
            return out

        self._zorro_loss_normalisers(data, self.ulysses_sequence_parallel_size)  # as the stock engine
        return_model_output = tu.get_non_tensor_data(data=data, key="return_model_output", default=False)

        mbs = self.zorro_micro_batches(data, local)
        micro_batches = [tu.index_select_tensor_dict(data, idx) for idx in mbs.batches]
        self._zorro_tree_stats = [0, 0]  # prefix sharing: tokens run by the plans, deepest tree

        output_lst = []
        ctx = torch.no_grad() if forward_only else nullcontext()
        scaler = getattr(self, "scaler", None)
        for i, micro_batch in enumerate(micro_batches):
            sync_ctx = nullcontext() if forward_only else self._gradient_sync_context(
                is_last_micro_batch=i == len(micro_batches) - 1)
            with ctx, sync_ctx, torch.profiler.record_function(f"zorro_micro_batch{i}"):
                loss, meta_info = self.forward_step(micro_batch, loss_function=loss_function,
                                                    forward_only=forward_only)
                if not forward_only:
                    if scaler is not None:
                        scaler.scale(loss).backward()
                    else:
                        loss.backward()
                    if not return_model_output:
                        meta_info.pop("model_output", None)
            output_lst.append(meta_info)

        out = postprocess_batch_func(output_lst=output_lst, indices=mbs.batches, data=data)
        if not tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=True):
            # verl restores the order only for dynamic bsz; group-aware fixed micro-batches reorder rows too.
            out["model_output"] = {k: restore_dynamic_batch(v, mbs.batches) for k, v in out["model_output"].items()}
        self._zorro_batch_metrics(out, data, mbs, hooks_missing)
        return out

    def _check_sp_batches_agree(self, data) -> None:
        """Every rank of an SP group must hold the same batch (verl all-gathers it over the SP group), since each
        builds the plan the exchanges rely on. A fingerprint (rows, tokens, a position-weighted token sum, the row
        offsets) is all-reduced MAX over the SP group as ``(x, -x)``; a mismatch in any group raises on every rank."""
        ids = data["input_ids"]
        vals = ids.values().long()
        w = torch.arange(1, vals.numel() + 1, device=vals.device) % 1009 + 1
        fp = torch.stack([torch.tensor(ids.shape[0], device=vals.device), torch.tensor(vals.numel(),
                          device=vals.device), (vals * w).sum(), ids.offsets().long().sum()]).to(get_device_id())
        both = torch.cat([fp, -fp])
        torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MAX, group=self.ulysses_parallel_group)
        # then over the whole mesh, so that every rank raises (ranks of other SP groups would otherwise wait in the
        # next collective)
        bad = torch.tensor([0 if torch.equal(both[: fp.numel()], -both[fp.numel():]) else 1], device=both.device)
        torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
        if int(bad.item()):
            raise ValueError("zorro engine: the ranks of a Ulysses sequence-parallel group hold different batches; "
                             "zorro builds the same plan on every SP rank from the batch, so they must agree (verl's "
                             "worker all-gathers the batch over the SP group: dispatch data by DP rank).")

    def forward_step(self, micro_batch, loss_function, forward_only):
        if not self.zorro_active or not self._installed():
            return super().forward_step(micro_batch, loss_function, forward_only)
        device_name = get_device_name()
        micro_batch = micro_batch.to(get_device_id())
        plan, media, p = micro_batch_plan(micro_batch, self.zorro.plan_kwargs(), self._zorro_media)
        self._zorro_count_plan(plan)
        shard = None
        if self.ulysses_sequence_parallel_size > 1:
            group = self.ulysses_parallel_group
            shard = ulysses_shard(plan, self.ulysses_sequence_parallel_size,
                                  torch.distributed.get_rank(group), group)

        temperature = micro_batch["temperature"]
        use_fused = tu.get_non_tensor_data(data=micro_batch, key="use_fused_kernels", default=False)
        if not isinstance(temperature, torch.Tensor) and not use_fused:
            temperature = torch.full((plan.B,), float(temperature), device=p.device)
        calculate_entropy = tu.get_non_tensor_data(data=micro_batch, key="calculate_entropy", default=False)

        autocast_dtype = getattr(self, "_autocast_dtype", torch.bfloat16)
        autocast_ctx = (nullcontext() if autocast_dtype == torch.float32
                        else torch.autocast(device_type=device_name, dtype=autocast_dtype))
        idle = nullcontext()
        if media is not None and not media.model_kwargs():
            idle = _idle_tower(self.module)  # no image here: the tower still runs (FSDP collectives, as verl)
        topk = tu.get_non_tensor_data(data=micro_batch, key="distillation_use_topk", default=False)
        with autocast_ctx, idle:
            if topk:  # the student's logits at the response-predicting rows feed verl's top-k loss
                model_output = self._topk_distillation_outputs(micro_batch, plan, p, temperature, calculate_entropy,
                                                               loss_function)
                return self._loss_and_output(model_output, micro_batch, loss_function, forward_only)
            if use_fused:  # verl's fused linear + log-prob kernel as the head (fused.py), one float temperature
                logp, ent = zorro_fused_step(self.module, plan, backend=self._zorro_backend, temperature=temperature,
                                             calculate_entropy=calculate_entropy, shard=shard)
            else:
                logp, ent = zorro_step(self.module, plan, backend=self._zorro_backend, temperature=temperature,
                                       calculate_entropy=calculate_entropy,
                                       logits_optimization=self.zorro.logits_optimization,
                                       chunk_size=self.logits_chunk_size, shard=shard, media=media)

            model_output = predict_next_outputs(micro_batch, p, plan, logp, ent if calculate_entropy else None)
            return self._loss_and_output(model_output, micro_batch, loss_function, forward_only)

    def _topk_distillation_outputs(self, micro_batch, plan, p, temperature, calculate_entropy: bool,
                                   loss_function) -> dict:
        """verl's model outputs for top-k distillation (``distillation_use_topk``), computed at the plan's
        response-predicting rows: the student's logits ``[N, V]`` (:func:`zorro_logits`), scaled by the rows'
        temperatures as verl does; ``log_probs`` (unless ``distillation_only``) and ``entropy`` from them with verl's
        own functions; and verl's logits processor (the bound ``distillation_ppo_loss`` called with
        ``student_logits``: ``distillation_losses``, ``student_mass``, ``teacher_mass``, overlap counts) on those
        rows, given the teacher's top-k ids / log-probs at the same entries of its jagged tensors
        (:func:`predict_next_index`). Each output goes into verl's nested layout at those entries (0 elsewhere, never
        read: verl's distillation loss reads them through ``no_padding_2_padding``, the response's predicting
        positions). Every output is a per-position function of that position's logits and teacher entries, so
        computing only the read positions, and each shared prompt once, leaves them and every gradient unchanged."""
        idx = predict_next_index(micro_batch, p, plan)
        logits = zorro_logits(self.module, plan, backend=self._zorro_backend)  # [N, V]
        if isinstance(temperature, torch.Tensor):
            t = temperature.reshape(-1)
            if t.numel() != plan.B:
                raise ValueError(f"temperature: expected one value per row ({plan.B}), got shape "
                                 f"{tuple(temperature.shape)}.")
            logits = logits / t[plan.out_row.to(t.device)].clamp(min=1e-8).to(logits.dtype)[:, None]
        elif float(temperature) != 1.0:
            logits = logits / torch.tensor(float(temperature)).clamp(min=1e-8).to(logits.dtype)
        out = {}
        ec = self.engine_config
        if calculate_entropy:  # verl's entropy options, on the kept rows
            if ec.entropy_checkpointing:
                ent = torch.utils.checkpoint.checkpoint(self.compute_entropy_from_logits, logits)
            elif ec.entropy_from_logits_with_chunking:
                ent = self.compute_entropy_from_logits(logits, chunk_size=ec.entropy_from_logits_chunk_size)
            else:
                ent = self.compute_entropy_from_logits(logits)
            out["entropy"] = to_predict_next(micro_batch, idx, ent)
        teacher = {}
        for key in ("teacher_logprobs", "teacher_ids"):
            rows = micro_batch[key].values()[idx.to(micro_batch[key].device)]  # [N, K]
            teacher[key] = torch.nested.nested_tensor_from_jagged(
                rows, torch.tensor([0, rows.shape[0]], device=rows.device))
        for key, v in loss_function(student_logits=logits.unsqueeze(0), data=teacher).items():
            out[key] = to_predict_next(micro_batch, idx, v.squeeze(0))
        if not tu.get_non_tensor_data(data=micro_batch, key="distillation_only", default=False):
            out["log_probs"] = to_predict_next(micro_batch, idx, logprobs_from_logits(
                logits=logits, labels=plan.target_ids.to(logits.device), inplace_backward=not calculate_entropy))
        return out

    def _loss_and_output(self, model_output: dict, micro_batch, loss_function, forward_only: bool):
        """verl's micro-batch result from the model outputs (nested ``[b, j_b]`` tensors in verl's layout): the loss
        (``loss_function``'s, or a dummy 1.0 for a forward-only pass) and ``{"model_output", "loss", "metrics"}``."""
        if loss_function is not None:
            loss, metrics = loss_function(model_output=model_output, data=micro_batch,
                                          dp_group=self.get_data_parallel_group())
        else:
            assert forward_only, "forward_only must be True when loss_function is None"
            loss = torch.tensor(1.0, device=get_device_name())
            metrics = {}
        output = {"model_output": detach_tree(model_output), "loss": loss.detach().item(), "metrics": metrics}
        return loss, output
