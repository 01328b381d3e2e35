"""The zorro FSDP engine for verl >= 0.9: ``FSDPEngineWithLMHead`` with a deduplicated micro-batch forward
(docs/DESIGN.md §8).

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
shards around zorro's attention and all-gathers the head's rows (docs/DESIGN.md §8).

With ``zorro.enable = false`` (or a stock ``FSDPEngineConfig``) every method is the stock one. Settings zorro cannot
run exactly raise, or with ``on_unsupported = warn`` run the stock forward for that batch, warn once and count the
batch in ``zorro/fallback_batches``.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager, nullcontext

import torch
from verl.utils import tensordict_utils as tu
from verl.utils.dataset.dataset_utils import DatasetPadMode
from verl.utils.device import get_device_id, get_device_name
from verl.utils.seqlen_balancing import restore_dynamic_batch
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
from zorro_verl.integrations.transformers.step import forward_owner, head_fn_unsupported
from zorro_verl.integrations.transformers.vision import is_multimodal, media_tokens
from zorro_verl.integrations.verl.common import ZorroActorMixin, dedup_metrics, setup_unsupported
from zorro_verl.integrations.verl.settings import settings_of
from zorro_verl.integrations.verl.v09.fused import zorro_fused_step
from zorro_verl.integrations.verl.v09.losses import loss_unsupported
from zorro_verl.integrations.verl.v09.markers import BALANCE_MARKER_KEY
from zorro_verl.integrations.verl.v09.vlm import restore_verl_methods, run_idle_tower, use_transformers_methods
from zorro_verl.logprob import linear_head_params
from zorro_verl.packing import build_plan, group_ids
from zorro_verl.packing.microbatch import dynamic_microbatches, fixed_size_microbatches, split_to_count
from zorro_verl.packing.multimodal import batch_media, build_media_plan
from zorro_verl.packing.tree import tree_row_costs
from zorro_verl.packing.ulysses import ulysses_shard

__all__ = ["ZorroFSDPEngineWithLMHead", "row_lengths", "row_group_ids"]

logger = logging.getLogger(__name__)


def row_lengths(td) -> tuple[torch.Tensor, torch.Tensor]:
    """Valid prompt and response tokens per row of a jagged verl batch: ``([B] int64, [B] int64)``.

    Same rule as verl's ``no_padding_2_padding``: from nested ``prompts``/``responses``, or from the padded
    ``attention_mask`` split at ``prompts.shape[1]``. Checked against the ``input_ids`` row lengths.
    """
    for key in ("input_ids", "prompts", "responses"):
        if key not in td.keys():
            raise ValueError(f"zorro engine: the batch has no '{key}' field; zorro needs the prompt/response split "
                             "of verl's rollout batch (prompts, responses, attention_mask, jagged input_ids).")
    prompts, responses = td["prompts"], td["responses"]
    if prompts.is_nested:
        p, r = prompts.offsets().diff(), responses.offsets().diff()
    else:
        am = td["attention_mask"]
        p, r = am[:, : prompts.shape[1]].sum(1), am[:, prompts.shape[1]:].sum(1)
    seq = td["input_ids"].offsets().diff()
    p, r = p.to(seq.device).long(), r.to(seq.device).long()
    if not torch.equal(p + r, seq):
        raise ValueError("zorro engine: prompt + response lengths from attention_mask do not add up to the jagged "
                         "input_ids lengths; the batch is not in verl's [prompt | response] layout.")
    if bool((p <= 0).any()):
        raise ValueError("zorro engine: a row has an empty prompt; every row needs at least one prompt token.")
    return p, r


def row_group_ids(td, p: torch.Tensor) -> torch.Tensor:
    """``[B] int64`` group id per row of a jagged batch (:func:`~zorro_verl.packing.group_ids` of its valid prompt
    tokens, right-aligned in a ``[B, Pmax]`` block)."""
    ids = td["input_ids"]
    vals, off = ids.values(), ids.offsets()
    B, pmax = p.numel(), int(p.max())
    row = torch.repeat_interleave(torch.arange(B, device=vals.device), p)
    j = torch.arange(row.numel(), device=vals.device) - torch.repeat_interleave(torch.cumsum(p, 0) - p, p)
    prompts = torch.zeros((B, pmax), dtype=torch.long, device=vals.device)
    mask = torch.zeros((B, pmax), dtype=torch.bool, device=vals.device)
    col = pmax - p[row] + j
    prompts[row, col] = vals[off[:-1][row] + j].long()
    mask[row, col] = True
    return group_ids(prompts, mask)


def _standard_positions(pos: torch.Tensor) -> bool:
    """Whether jagged ``position_ids`` count ``0, 1, 2, ...`` along each row (verl's text layout; one host read).
    Padded position ids are not read here (only the no-padding layout runs zorro)."""
    if not pos.is_nested:
        return True
    vals, off = pos.values(), pos.offsets().to(pos.values().device)
    start = torch.repeat_interleave(off[:-1], off.diff())
    return bool((vals.long() == torch.arange(vals.numel(), device=vals.device) - start).all())


def _to_verl_padded(nested: torch.Tensor, p: torch.Tensor, r: torch.Tensor, pw: int, rw: int, fill: int = 0):
    """Jagged ``[prompt | response]`` rows -> verl's left/right padded ``[B, pw + rw]`` (plus the index used)."""
    vals, off = nested.values(), nested.offsets()
    seq = p + r
    B = seq.numel()
    row = torch.repeat_interleave(torch.arange(B, device=vals.device), seq)
    j = torch.arange(vals.shape[0], device=vals.device) - off[:-1][row]
    pr = p[row]
    col = torch.where(j < pr, pw - pr + j, pw + j - pr)
    out = torch.full((B, pw + rw), fill, dtype=vals.dtype, device=vals.device)
    out[row, col] = vals
    return out, row, col


def _row_media(td) -> list:
    """Per row of a verl batch, its multimodal inputs dict (``pixel_values``, ``image_grid_thw``, ...) or None: verl
    stores one entry per row in ``multi_modal_inputs`` (a dict, possibly wrapped in ``NonTensorData``; empty for a
    text row)."""
    if "multi_modal_inputs" not in td.keys():
        return [None] * td["input_ids"].shape[0]
    out = []
    for entry in td["multi_modal_inputs"]:
        entry = getattr(entry, "data", entry)
        out.append(entry if entry else None)
    return out


def _positions_3d(pos: torch.Tensor, row: torch.Tensor, col: torch.Tensor, width: int) -> torch.Tensor:
    """verl's jagged 3-D position ids (``[B, k, S_b]``, ``k`` = 4: text positions then the three rotary axes, or 3)
    -> ``[k, B, width]`` in the padded layout of ``_to_verl_padded`` (``row``, ``col`` of each jagged token)."""
    vals = pos.values()  # [k, total] (verl: values().unsqueeze(1) is the model's [k, 1, total])
    if vals.dim() != 2 or vals.shape[0] not in (3, 4):
        raise ValueError(f"position_ids: expected verl's jagged 3-D position ids with 3 or 4 rows per token, got "
                         f"values of shape {tuple(vals.shape)}.")
    out = vals.new_zeros((vals.shape[0], pos.shape[0], width))
    out[:, row, col] = vals
    return out


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


class ZorroFSDPEngineWithLMHead(ZorroActorMixin, FSDPEngineWithLMHead):
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

    # ------------------------------------------------------------------ support checks
    def _zorro_static_unsupported(self):
        mc = self.model_config
        sp = self.engine_config.ulysses_sequence_parallel_size
        return setup_unsupported(sp, getattr(mc, "hf_config", None), ulysses_supported=True, vlm_supported=True)

    def _zorro_batch_unsupported(self, data):
        get = tu.get_non_tensor_data
        if get(data=data, key="pad_mode", default=DatasetPadMode.NO_PADDING) != DatasetPadMode.NO_PADDING:
            return "pad_mode other than no_padding"
        for key in ("distillation_use_topk", "distillation_only", "calculate_sum_pi_squared"):
            if get(data=data, key=key, default=False):
                return f"{key}=True"
        if (get(data=data, key="use_fused_kernels", default=False) and "temperature" in data.keys()
                and isinstance(data["temperature"], torch.Tensor)):
            # verl's fused path asserts one float temperature per batch
            return "per-sample temperature tensors with use_fused_kernels=True (verl's fused kernels take one float)"
        if self.zorro.logits_optimization == "memory" and "temperature" in data.keys():
            t = data["temperature"]
            if isinstance(t, torch.Tensor) and t.numel() > 1 and not bool((t == t.reshape(-1)[0]).all()):
                return "per-sample temperatures with logits_optimization=memory"
        if get(data=data, key="force_group_size", default=1) != 1:
            return "force_group_size > 1"
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

    @staticmethod
    def _zorro_multimodal(data) -> bool:
        """Whether ``data`` is a vision-language batch: real multimodal inputs (verl's V1 agent loop stores an empty
        entry per sample for text-only data) or 3-D position ids."""
        if "position_ids" in data.keys() and data["position_ids"].dim() == 3:
            return True
        return "multi_modal_inputs" in data.keys() and any(_row_media(data))

    def _zorro_media(self, data, ids_pad, am, rw):
        """The :class:`~zorro_verl.packing.multimodal.BatchMedia` of a vision-language batch (content keys, keyed
        ids), None for a text batch."""
        if not self._zorro_multimodal(data):
            return None
        return batch_media(ids_pad, am, rw, _row_media(data), media_tokens(self.module))

    # ------------------------------------------------------------------ model
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
        counts Ulysses cannot shard; the ``memory`` logits mode computes the head as ``F.linear(hidden,
        weight, bias)`` and needs the head's output returned unchanged as the logits."""
        reason = lora_unsupported(self.module)
        if reason is not None:
            return reason
        sp = self.ulysses_sequence_parallel_size
        if sp > 1:
            cfg = text_config(self.module)
            try:
                check_ulysses_heads(cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None)
                                    or cfg.num_attention_heads, sp)
                for _, mod in linear_attention_modules(self.module):  # gated delta-nets exchange their heads too
                    linear_attention_sp_repeat(mod.num_k_heads, mod.num_v_heads, sp)
            except ValueError as e:
                return str(e)
        if self.zorro.logits_optimization != "memory":
            return None
        try:
            linear_head_params(forward_owner(self.module.get_output_embeddings()))
        except ValueError as e:
            return f"logits_optimization=memory with this model's head ({e})"
        reason = head_fn_unsupported(self.module)
        return None if reason is None else f"logits_optimization=memory: {reason}"

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
        hooks_missing = {"zorro/balance_hooks_missing": self._zorro_balance_hooks_missing(data)}
        reason, local = self._zorro_static_reason, None
        if reason is None:
            # Every check that can fail on one rank runs before the ranks agree (a rank raising or branching alone
            # would leave its peers waiting in the next collective): the unsupported settings, the batch's layout
            # and its micro-batching. The loss settings travel with each call (the bound actor config).
            error = None
            try:
                reason = self._zorro_batch_unsupported(data) or loss_unsupported(loss_function, data)
                if reason is None:
                    local = self._zorro_local_micro_batches(data)
            except Exception as e:  # noqa: BLE001 - raised by the agreement, on this rank and (quoted) on every other
                error = e
            # The two paths issue different collectives: every rank of the DP x SP mesh must take the same one.
            reason = self._zorro_agreed_reason(reason, error)
        if reason is None and self.ulysses_sequence_parallel_size > 1:
            self._check_sp_batches_agree(data)
        if reason is not None:
            if self._zorro_static_reason is None:
                self._zorro_unsupported(reason)
            with self._stock_attention():
                out = super().forward_backward_batch(data, loss_function, forward_only=forward_only)
            self._add_metrics(out, {"zorro/fallback_batches": 1.0, **hooks_missing})
            return out

        tu.assign_non_tensor(data, sp_size=self.ulysses_sequence_parallel_size)
        return_model_output = tu.get_non_tensor_data(data=data, key="return_model_output", default=False)
        batch_num_tokens = data["loss_mask"].sum().to(get_device_id())
        torch.distributed.all_reduce(batch_num_tokens, op=torch.distributed.ReduceOp.SUM,
                                     group=self.get_data_parallel_group())
        tu.assign_non_tensor(data, batch_num_tokens=batch_num_tokens.item())
        tu.assign_non_tensor(data, dp_size=self.get_data_parallel_size())

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
        ordinary, computed = mbs.ordinary_tokens, mbs.dedup_tokens
        if self.zorro.sharing == "prefix":  # the rows' and the trees' own counts (mbs holds the packing costs)
            ordinary = int(data["input_ids"].offsets()[-1])
            computed, depth = self._zorro_tree_stats
            self._add_metrics(out, {"zorro/tree_depth": float(depth)})
        self._add_metrics(out, dedup_metrics(ordinary, computed, mbs.split_groups, 0))
        # tokens actually run: with prompt_tokens_saved, the trainer scales verl's MFU to zorro/effective_mfu/<pass>
        self._add_metrics(out, {"zorro/computed_tokens": float(computed), **hooks_missing})
        self.zorro_last_micro_batches = mbs
        return out

    def _zorro_agreed_reason(self, reason, error=None):
        """This rank's unsupported ``reason`` (or None) and the ``error`` its checks raised (or None) made the same
        decision on every rank: an all-reduce (MAX) of two flags, so that if any rank's batch is unsupported all
        ranks raise (``on_unsupported=raise``) or all run the stock forward (``warn``), and if any rank's checks
        failed all ranks raise (the zorro and stock paths issue different collectives; a rank raising or branching
        alone would leave the others waiting). One collective per call; when the ranks raise, one more gathers the
        first failing rank's message, which the other ranks quote."""
        raising = error is not None or (reason is not None and self.zorro.on_unsupported == "raise")
        flags = torch.tensor([int(reason is not None), int(raising)], device=get_device_id())
        # the whole mesh (DP x SP): FSDP's collectives and the Ulysses exchanges span all ranks
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        any_reason, any_raising = (int(v) for v in flags.tolist())
        if any_raising:
            mine = (f"{type(error).__name__}: {error}" if error is not None
                    else f"zorro: unsupported setting: {reason}" if raising else None)
            messages = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(messages, mine)
            if error is not None:
                raise error
            if raising:
                self._zorro_unsupported(reason)  # raises with the fix
            rank, msg = next((i, m) for i, m in enumerate(messages) if m is not None)
            raise ValueError(f"zorro engine: the batch of rank {rank} cannot run (every rank stops here, so that none "
                             f"waits for it in a collective). Rank {rank}: {msg}")
        if reason is None and any_reason:
            return ("the batch of another data-parallel rank is unsupported (see that rank's message); all ranks "
                    "take the same path")
        return reason

    def _zorro_balance_hooks_missing(self, data) -> float:
        """1.0 (warned once per engine) when zorro's group balancing is on but the batch carries no stamp of the
        trainer's balance hook (:mod:`.markers`): the trainer process did not install zorro's hooks, so verl's length
        balancing scattered each prompt's rollouts over the DP ranks; else 0.0. Counted in
        ``zorro/balance_hooks_missing``."""
        if not self.zorro.group_balance or tu.get_non_tensor_data(data=data, key=BALANCE_MARKER_KEY, default=False):
            return 0.0
        if "balance_hooks_missing" not in self._zorro_warned:
            self._zorro_warned.add("balance_hooks_missing")
            logger.warning(
                "zorro: this batch did not pass through zorro's group-aware balancing in the trainer (no %r stamp): "
                "the trainer process did not install zorro's hooks (e.g. VERL_USE_EXTERNAL_PLUGINS excludes the "
                "zorro_verl entry point and actor_rollout_ref.model.external_lib does not name "
                "zorro_verl.integrations.verl.v09.plugin), or the trainer does not balance "
                "(trainer.balance_batch=false). verl's length balancing then scatters each prompt's rollouts over the "
                "DP ranks and deduplication saves little. Fix: set actor_rollout_ref.model.external_lib="
                "zorro_verl.integrations.verl.v09.plugin (or let VERL_USE_EXTERNAL_PLUGINS load zorro_verl); or set "
                "fsdp_config.zorro.group_balance=false if the trainer's balancing is off on purpose. Counted in "
                "zorro/balance_hooks_missing.", BALANCE_MARKER_KEY)
        return 1.0

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

    @staticmethod
    def _add_metrics(out, values: dict) -> None:
        if out is None:
            return
        metrics = out.setdefault("metrics", {})
        for k, v in values.items():
            metrics.setdefault(k, []).append(v)

    def zorro_micro_batches(self, data, local=None):
        """Group-aware micro-batches of ``data`` (row index lists), the same count on every DP rank; ``local``: this
        rank's own packing, :meth:`_zorro_local_micro_batches` (computed here when None)."""
        mbs, g, p, r = self._zorro_local_micro_batches(data) if local is None else local
        # FSDP collectives need the same number of forward/backward calls on every DP rank.
        # Over the whole DP x SP mesh: the ranks of an SP group hold the same batch (checked) and agree anyway.
        # The fewest rows of any rank come with it (MAX of -rows), so that every rank can tell whether all can split.
        counts = torch.tensor([len(mbs), -len(g)], device=get_device_id())
        torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.MAX)
        count, fewest = int(counts[0]), -int(counts[1])
        if count > fewest:
            raise ValueError(f"zorro engine: the ranks need {count} micro-batches (the most any rank's batch needs; "
                             f"FSDP runs the same number on every rank), but a rank holds only {fewest} rows and every "
                             "micro-batch needs one (all ranks raise this). Give the DP ranks equal row counts (verl's "
                             "balancing does), or raise max_token_len_per_gpu / micro_batch_size_per_gpu.")
        if count > len(mbs):
            mbs = split_to_count(mbs, count, g, p, r)
        return mbs

    def _zorro_local_micro_batches(self, data):
        """This rank's group-aware micro-batches of ``data`` and the units they were packed from: ``(mbs, g, p,
        r)``. Raises on a batch zorro cannot read or pack (no collective: run before the ranks agree)."""
        p, r = row_lengths(data)
        r_split = None
        media = None
        if self.zorro.sharing == "prefix" or self._zorro_multimodal(data):
            ids_pad, row, col = _to_verl_padded(data["input_ids"], p, r, int(p.max()), int(r.max()))
            am = torch.zeros_like(ids_pad)
            am[row, col] = 1
            # a vision-language batch groups on keyed ids: rows share only where tokens and images are equal
            media = self._zorro_media(data, ids_pad, am, int(r.max()))
            if media is not None:
                ids_pad = media.keyed_ids
        if self.zorro.sharing == "prefix":  # trie clusters: the root once, each inner node paid by one row
            tc = tree_row_costs(ids_pad, am, int(r.max()), self.zorro.min_shared_len)
            g, p, r, r_split = tc["cluster"], tc["root_len"], tc["own"], tc["below_root"]
        elif media is not None:
            pw = int(p.max())
            g = group_ids(ids_pad[:, :pw], am[:, :pw].bool())
        else:
            g = row_group_ids(data, p)
        sp = self.ulysses_sequence_parallel_size
        if tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=True):
            # the budget of one SP group's micro-batch (as verl: per-GPU budget x sp), each prompt counted once
            max_tok = int(tu.get(data, "max_token_len_per_gpu")) * sp
            mbs = dynamic_microbatches(g, p, r, max_tok, split_response_lens=r_split)
        else:
            mbs = fixed_size_microbatches(g, p, r, int(tu.get(data, "micro_batch_size_per_gpu")))
        return mbs, g, p, r

    # ------------------------------------------------------------------ micro-batch
    def forward_step(self, micro_batch, loss_function, forward_only):
        if not self.zorro_active or not self._installed():
            return super().forward_step(micro_batch, loss_function, forward_only)
        device_name = get_device_name()
        micro_batch = micro_batch.to(get_device_id())
        p, r = row_lengths(micro_batch)
        pw, rw = int(p.max()), int(r.max())
        ids_pad, row, col = _to_verl_padded(micro_batch["input_ids"], p, r, pw, rw)
        am = torch.zeros_like(ids_pad)
        am[row, col] = 1
        media = None
        if self._zorro_multimodal(micro_batch):  # images once per unique prompt, 3-D positions from the rows
            plan, media = build_media_plan(ids_pad, am, rw, self._zorro_media(micro_batch, ids_pad, am, rw), None,
                                           _positions_3d(micro_batch["position_ids"], row, col, pw + rw),
                                           **self.zorro.plan_kwargs())
        else:
            pos_pad = _to_verl_padded(micro_batch["position_ids"], p, r, pw, rw)[0]
            plan = build_plan(ids_pad, am, rw, position_ids=pos_pad * am, **self.zorro.plan_kwargs())
        if plan.tree is not None and getattr(self, "_zorro_tree_stats", None) is not None:
            self._zorro_tree_stats[0] += plan.T
            self._zorro_tree_stats[1] = max(self._zorro_tree_stats[1], plan.tree.levels)
        shard = None
        if self.ulysses_sequence_parallel_size > 1:
            group = self.ulysses_parallel_group
            shard = ulysses_shard(plan, self.ulysses_sequence_parallel_size,
                                  torch.distributed.get_rank(group), group)

        temperature = micro_batch["temperature"]
        use_fused = tu.get_non_tensor_data(data=micro_batch, key="use_fused_kernels", default=False)
        if not isinstance(temperature, torch.Tensor) and not use_fused:
            temperature = torch.full((plan.B,), float(temperature), device=ids_pad.device)
        calculate_entropy = tu.get_non_tensor_data(data=micro_batch, key="calculate_entropy", default=False)

        autocast_dtype = getattr(self, "_autocast_dtype", torch.bfloat16)
        autocast_ctx = (nullcontext() if autocast_dtype == torch.float32
                        else torch.autocast(device_type=device_name, dtype=autocast_dtype))
        idle = nullcontext()
        if media is not None and not media.model_kwargs():
            idle = _idle_tower(self.module)  # no image here: the tower still runs (FSDP collectives, as verl)
        with autocast_ctx, idle:
            if use_fused:  # verl's fused linear + log-prob kernel as the head (fused.py), one float temperature
                logp, ent = zorro_fused_step(self.module, plan, backend=self._zorro_backend, temperature=temperature,
                                             calculate_entropy=calculate_entropy, shard=shard)
            else:
                logp, ent = zorro_step(self.module, plan, backend=self._zorro_backend, temperature=temperature,
                                       calculate_entropy=calculate_entropy,
                                       logits_optimization=self.zorro.logits_optimization,
                                       chunk_size=self.logits_chunk_size, shard=shard, media=media)

            offsets = micro_batch["input_ids"].offsets()
            # predict-next layout: the token at column j of row b's response is predicted at row position p_b-1+j
            idx = offsets[:-1][plan.out_row] + p[plan.out_row] - 1 + plan.out_col
            total = int(offsets[-1])
            model_output = {"log_probs": torch.nested.nested_tensor_from_jagged(
                logp.new_zeros(total).index_put((idx,), logp), offsets)}
            if calculate_entropy:
                model_output["entropy"] = torch.nested.nested_tensor_from_jagged(
                    ent.new_zeros(total).index_put((idx,), ent), offsets)

            if loss_function is not None:
                loss, metrics = loss_function(model_output=model_output, data=micro_batch,
                                              dp_group=self.get_data_parallel_group())
            else:
                assert forward_only, "forward_only must be True when loss_function is None"
                loss = torch.tensor(1.0, device=device_name)
                metrics = {}
            output = {"model_output": detach_tree(model_output), "loss": loss.detach().item(), "metrics": metrics}
            return loss, output
