"""Batch handling shared by the zorro engines of verl >= 0.9 (FSDP and Megatron; docs/design/verl.md): verl's jagged
batch read as rows (prompt / response lengths, group ids), group-aware micro-batches with the same count on every
rank, the plan of one micro-batch, the deduplicated log-probs written back in verl's nested predict-next layout, the
all-rank agreement on the path a batch takes, and the zorro metrics.

Nothing here imports a verl engine: :class:`ZorroBatchingMixin` is mixed into each engine class beside
:class:`~zorro_verl.integrations.verl.common.ZorroActorMixin`. An engine provides ``self.zorro`` (the settings),
``self.module`` (for vision-language batches) and :meth:`ZorroBatchingMixin._zorro_sp_size`.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from verl.utils import tensordict_utils as tu
from verl.utils.dataset.dataset_utils import DatasetPadMode
from verl.utils.device import get_device_id

from zorro_verl.integrations.transformers.vision import media_tokens
from zorro_verl.integrations.verl.common import dedup_metrics
from zorro_verl.integrations.verl.v09.losses import loss_unsupported
from zorro_verl.integrations.verl.v09.markers import BALANCE_MARKER_KEY
from zorro_verl.packing import ZorroPlan, build_plan, group_ids
from zorro_verl.packing.microbatch import dynamic_microbatches, fixed_size_microbatches, split_to_count
from zorro_verl.packing.multimodal import batch_media, build_media_plan, check_shared_positions
from zorro_verl.packing.tree import tree_row_costs

__all__ = ["ZorroBatchingMixin", "row_lengths", "row_group_ids", "micro_batch_plan", "predict_next_outputs",
           "predict_next_index", "to_predict_next",
           "common_batch_unsupported", "is_sft_batch", "sft_unsupported", "sft_split"]

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


def common_batch_unsupported(data, *, topk_distillation: bool = False) -> Optional[str]:
    """Why a batch cannot run zorro in a verl 0.9 engine, or None: a padded layout, the engine's extra head outputs
    (the sum of squared probabilities; top-k distillation unless ``topk_distillation``: the FSDP LM-head engine
    produces it), forced group sizes."""
    get = tu.get_non_tensor_data
    if get(data=data, key="pad_mode", default=DatasetPadMode.NO_PADDING) != DatasetPadMode.NO_PADDING:
        return "pad_mode other than no_padding"
    keys = ("calculate_sum_pi_squared",) if topk_distillation else (
        "distillation_use_topk", "distillation_only", "calculate_sum_pi_squared")
    for key in keys:
        if get(data=data, key=key, default=False):
            return f"{key}=True"
    if get(data=data, key="force_group_size", default=1) != 1:
        return "force_group_size > 1"
    return None


def is_sft_batch(data) -> bool:
    """Whether ``data`` is verl's SFT batch (``verl.trainer.sft_trainer``, ``pad_mode: no_padding``): jagged
    ``input_ids`` with a ``loss_mask`` over the assistant tokens and no prompt/response split (no ``prompts`` /
    ``responses`` fields, which every RL batch carries)."""
    keys = data.keys()
    return "loss_mask" in keys and "prompts" not in keys and "responses" not in keys


def sft_unsupported(data) -> Optional[str]:
    """Why the SFT batch ``data`` (:func:`is_sft_batch`) cannot run zorro, or None.

    * ``input_ids`` / ``loss_mask`` not jagged, or of other row lengths: not verl's ``no_padding`` layout;
    * a row whose **first** token is in the loss mask: nothing predicts it, and verl's ``sft_loss`` rolls the
      flattened mask, so that bit lands on the previous row's last position (the micro-batch's last row for its first
      row), a term that depends on which rows share a micro-batch, which zorro changes."""
    ids, mask = data["input_ids"], data["loss_mask"]
    if not (ids.is_nested and mask.is_nested):
        return ("an SFT batch whose input_ids / loss_mask are not jagged (data.pad_mode other than no_padding; zorro "
                "reads the no_padding layout: set data.pad_mode=no_padding)")
    off = ids.offsets()
    if not torch.equal(mask.offsets().to(off.device), off):
        return ("an SFT batch whose loss_mask rows differ in length from its input_ids rows (not verl's SFT layout: "
                "one loss_mask entry per token)")
    lens = off.diff()
    if bool((mask.values().to(off.device)[off[:-1][lens > 0]] != 0).any()):
        return ("an SFT row whose first token is in the loss_mask (nothing predicts it; verl's sft_loss rolls the "
                "flattened mask, so that bit lands on the previous row's last position, a term that depends on which "
                "rows share a micro-batch): mask the first token of every sample (verl's multi-turn SFT dataset "
                "does: it is a system / user token)")
    return None


def sft_split(data) -> None:
    """Give an SFT batch (:func:`is_sft_batch`, checked by :func:`sft_unsupported`) the prompt/response split zorro
    runs on, in place: nested ``prompts [B, j]`` and ``responses [B, j]`` (int64, jagged like ``input_ids``).

    verl's ``sft_loss`` reads the nested predict-next log-probs at every position ``t`` whose rolled ``loss_mask``
    (``loss_mask[t + 1]``) is set. Row ``b``'s "prompt" is its tokens before the first loss token ``f_b`` (at least
    one token), its "response" the rest (later user turns included: their log-probs are computed, their loss mask is
    0), so zorro computes log-probs at ``[f_b - 1, L_b - 1)``, every position the loss reads, and 0 elsewhere, where
    the rolled mask is 0. A row without loss tokens is all prompt (a 0-token response)."""
    ids, mask = data["input_ids"], data["loss_mask"]
    off = ids.offsets()
    lens = off.diff()
    m = mask.values().to(off.device) != 0
    B = lens.numel()
    row = torch.repeat_interleave(torch.arange(B, device=off.device), lens)
    pos = torch.arange(m.numel(), device=off.device) - off[:-1][row]
    first = torch.full((B,), torch.iinfo(torch.long).max, dtype=torch.long, device=off.device)
    first = first.scatter_reduce(0, row[m], pos[m], reduce="amin")
    p = torch.minimum(first, lens)  # rows without loss tokens: all prompt
    vals = ids.values()
    in_prompt = pos < p[row]
    zero = off.new_zeros(1)
    data["prompts"] = torch.nested.nested_tensor_from_jagged(vals[in_prompt], torch.cat([zero, p.cumsum(0)]))
    data["responses"] = torch.nested.nested_tensor_from_jagged(vals[~in_prompt],
                                                               torch.cat([zero, (lens - p).cumsum(0)]))


def micro_batch_plan(micro_batch, plan_kwargs: dict, media_of=None, positions_of=None):
    """The plan of one jagged micro-batch: ``(plan, media, p)`` with ``p [B] int64`` the prompt lengths. Text
    batches: :func:`~zorro_verl.packing.build_plan` on verl's positions (checked to count ``0, 1, ...`` per row by the
    batch checks); vision-language batches (``media_of(micro_batch, ids_pad, am, rw)`` gives their
    :class:`~zorro_verl.packing.multimodal.BatchMedia`, None for text): images once per unique prompt and 3-D positions
    from the rows (:func:`~zorro_verl.packing.multimodal.build_media_plan`): verl's ``position_ids``, or
    ``positions_of(micro_batch, ids_pad, am) -> [3, B, S]`` when given (``ids_pad`` / ``am`` the padded layout)."""
    p, r = row_lengths(micro_batch)
    pw, rw = int(p.max()), int(r.max())
    ids_pad, row, col = _to_verl_padded(micro_batch["input_ids"], p, r, pw, rw)
    am = torch.zeros_like(ids_pad)
    am[row, col] = 1
    media = None if media_of is None else media_of(micro_batch, ids_pad, am, rw)
    if media is not None:
        pos = (_positions_3d(micro_batch["position_ids"], row, col, pw + rw) if positions_of is None
               else positions_of(micro_batch, ids_pad, am))
        plan, media = build_media_plan(ids_pad, am, rw, media, None, pos, **plan_kwargs)
    else:
        pos_pad = None
        if "position_ids" in micro_batch.keys():
            pos_pad = _to_verl_padded(micro_batch["position_ids"], p, r, pw, rw)[0] * am
        plan = build_plan(ids_pad, am, rw, position_ids=pos_pad, **plan_kwargs)
    return plan, media, p


def predict_next_outputs(micro_batch, p: torch.Tensor, plan: ZorroPlan, log_probs: torch.Tensor,
                         entropy: Optional[torch.Tensor]) -> dict:
    """``log_probs [N]`` / ``entropy [N]`` (the plan's response tokens) in verl's nested predict-next layout: jagged
    like ``input_ids``, row ``b``'s slice ``[p_b - 1, p_b + r_b - 1)`` holds its response log-probs (the token at
    response column ``j`` is predicted at row position ``p_b - 1 + j``); other entries are 0 and never read."""
    idx = predict_next_index(micro_batch, p, plan)
    out = {"log_probs": to_predict_next(micro_batch, idx, log_probs)}
    if entropy is not None:
        out["entropy"] = to_predict_next(micro_batch, idx, entropy)
    return out


def predict_next_index(micro_batch, p: torch.Tensor, plan: ZorroPlan) -> torch.Tensor:
    """``[N] int64``: for each of the plan's outputs, its entry in the jagged micro-batch's values
    (``input_ids.values()``, and every per-token tensor verl keeps jagged like it, e.g. the teacher's top-k): row
    ``b``'s position ``p_b - 1 + j`` predicts its response token ``j``."""
    offsets = micro_batch["input_ids"].offsets()
    return offsets[:-1][plan.out_row] + p[plan.out_row] - 1 + plan.out_col


def to_predict_next(micro_batch, idx: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``values [N, ...]`` (the plan's outputs) as a nested tensor jagged like ``input_ids``, at ``idx``
    (:func:`predict_next_index`); other entries 0 (never read: verl reads the predict-next positions only)."""
    offsets = micro_batch["input_ids"].offsets()
    full = values.new_zeros((int(offsets[-1]), *values.shape[1:])).index_put((idx,), values)
    return torch.nested.nested_tensor_from_jagged(full, offsets)


class ZorroBatchingMixin:
    """Batch-level zorro logic of a verl 0.9 engine (see module docstring)."""

    def _zorro_decide(self, data, loss_function) -> tuple:
        """Which path this batch takes, agreed by every rank: ``(reason, local, hooks_missing)`` — the unsupported
        reason (None: zorro runs), this rank's own micro-batching (:meth:`_zorro_local_micro_batches`, when zorro
        runs) and the ``zorro/balance_hooks_missing`` metric. Every check that can fail on one rank runs before the
        ranks agree (a rank raising or branching alone would leave its peers waiting in the next collective): the
        unsupported settings, the batch's layout and its micro-batching. The loss settings travel with each call
        (the bound actor config)."""
        hooks_missing = {"zorro/balance_hooks_missing": self._zorro_balance_hooks_missing(data)}
        self._zorro_media_memo = {}  # pixels hashed once per batch (_zorro_media)
        reason, local = self._zorro_static_reason, None
        if reason is None:
            error = None
            try:
                reason = self._zorro_batch_unsupported(data) or loss_unsupported(loss_function, data)
                if reason is None:
                    local = self._zorro_local_micro_batches(data)
            except Exception as e:  # noqa: BLE001 - raised by the agreement, on this rank and (quoted) on every other
                error = e
            # The two paths issue different collectives: every rank of the mesh must take the same one.
            reason = self._zorro_agreed_reason(reason, error)
        return reason, local, hooks_missing

    def _zorro_loss_normalisers(self, data, sp_size: int) -> None:
        """What the stock engines set on a batch before micro-batching, so that verl's loss normalises globally:
        ``sp_size``, ``batch_num_tokens`` (the loss tokens all-reduced over the DP group) and ``dp_size``."""
        tu.assign_non_tensor(data, sp_size=sp_size)
        loss_mask = data["loss_mask"]
        batch_num_tokens = (loss_mask.values().sum() if loss_mask.is_nested else loss_mask.sum()).to(get_device_id())
        torch.distributed.all_reduce(batch_num_tokens, op=torch.distributed.ReduceOp.SUM,
                                     group=self.get_data_parallel_group())
        tu.assign_non_tensor(data, batch_num_tokens=batch_num_tokens.item())
        tu.assign_non_tensor(data, dp_size=self.get_data_parallel_size())

    def _zorro_sp_size(self) -> int:
        """Ranks that hold the same batch and split its sequence (Ulysses SP on FSDP; 1 elsewhere): a dynamic
        micro-batch's token budget is the per-GPU budget times this."""
        return 1

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
        # the batch's content keys, shared by its grouping and its micro-batches' plans (reset per batch by
        # _zorro_decide: the rows' tensors stay alive through one forward_backward_batch)
        return batch_media(ids_pad, am, rw, _row_media(data), media_tokens(self.module),
                           memo=getattr(self, "_zorro_media_memo", None))

    def _zorro_rows_positions(self, data, ids_pad, am, row, col):
        """The rows' 3-D rotary positions ``[k, B, S]`` in the padded layout of ``ids_pad [B, S]`` (verl's
        ``position_ids``; None without them), which the micro-batches' plans will read. ``row`` / ``col``: each jagged
        token's place in that layout."""
        if "position_ids" not in data.keys():
            return None
        return _positions_3d(data["position_ids"], row, col, ids_pad.shape[1])

    # ------------------------------------------------------------------ model
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
        if (not self.zorro.group_balance or is_sft_batch(data)  # the SFT trainer has no balancing step to hook
                or tu.get_non_tensor_data(data=data, key=BALANCE_MARKER_KEY, default=False)):
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
                "fsdp_config.zorro.group_balance=false (megatron.zorro.group_balance on the Megatron engine) if the "
                "trainer's balancing is off on purpose. Counted in zorro/balance_hooks_missing.", BALANCE_MARKER_KEY)
        return 1.0

    @staticmethod
    def _add_metrics(out, values: dict) -> None:
        if out is None:
            return
        metrics = out.setdefault("metrics", {})
        for k, v in values.items():
            metrics.setdefault(k, []).append(v)

    def zorro_micro_batches(self, data, local=None, multiple_of: int = 1):
        """Group-aware micro-batches of ``data`` (row index lists), the same count on every DP rank; ``local``: this
        rank's own packing, :meth:`_zorro_local_micro_batches` (computed here when None); ``multiple_of``: the count
        is rounded up to a multiple of it (megatron's interleaved schedule runs micro-batches in groups of
        ``microbatch_group_size_per_vp_stage``, as verl's ``num_batches_divided_by``)."""
        mbs, g, p, r = self._zorro_local_micro_batches(data) if local is None else local
        # FSDP collectives need the same number of forward/backward calls on every DP rank.
        # Over the whole DP x SP mesh: the ranks of an SP group hold the same batch (checked) and agree anyway.
        # The fewest rows of any rank come with it (MAX of -rows), so that every rank can tell whether all can split.
        counts = torch.tensor([len(mbs), -len(g)], device=get_device_id())
        torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.MAX)
        count, fewest = int(counts[0]), -int(counts[1])
        count = -(-count // multiple_of) * multiple_of
        if count > fewest:
            raise ValueError(f"zorro engine: the ranks need {count} micro-batches (the most any rank's batch needs"
                             + (f", rounded up to a multiple of {multiple_of} for megatron's interleaved schedule"
                                if multiple_of > 1 else "")
                             + f"; the schedule runs the same number on every rank), but a rank holds only {fewest} "
                             "rows and every micro-batch needs one (all ranks raise this). Give the DP ranks equal row "
                             "counts (verl's balancing does), or raise max_token_len_per_gpu / "
                             "micro_batch_size_per_gpu.")
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
                pos = self._zorro_rows_positions(data, ids_pad, am, row, col)
                ids_pad = media.keyed_ids
                if pos is not None:  # what the plans will require, checked before the ranks agree
                    check_shared_positions(ids_pad, p + r, pos,
                                           shared_cap=None if self.zorro.sharing == "prefix" else p)
        if self.zorro.sharing == "prefix":  # trie clusters: the root once, each inner node paid by one row
            tc = tree_row_costs(ids_pad, am, int(r.max()), self.zorro.min_shared_len)
            g, p, r, r_split = tc["cluster"], tc["root_len"], tc["own"], tc["below_root"]
        elif media is not None:
            pw = int(p.max())
            g = group_ids(ids_pad[:, :pw], am[:, :pw].bool())
        else:
            g = row_group_ids(data, p)
        sp = self._zorro_sp_size()
        if tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=True):
            # the budget of one SP group's micro-batch (as verl: per-GPU budget x sp), each prompt counted once
            max_tok = int(tu.get(data, "max_token_len_per_gpu")) * sp
            mbs = dynamic_microbatches(g, p, r, max_tok, split_response_lens=r_split)
        else:
            mbs = fixed_size_microbatches(g, p, r, int(tu.get(data, "micro_batch_size_per_gpu")))
        return mbs, g, p, r

    def _zorro_batch_metrics(self, out, data, mbs, hooks_missing: dict) -> None:
        """The zorro metrics of one ``forward_backward_batch`` (dedup ratio, split groups, tokens run, tree depth)."""
        ordinary, computed = mbs.ordinary_tokens, mbs.dedup_tokens
        if self.zorro.sharing == "prefix":  # the rows' and the trees' own counts (mbs holds the packing costs)
            ordinary = int(data["input_ids"].offsets()[-1])
            computed, depth = self._zorro_tree_stats
            self._add_metrics(out, {"zorro/tree_depth": float(depth)})
        self._add_metrics(out, dedup_metrics(ordinary, computed, mbs.split_groups, 0))
        # tokens actually run: with prompt_tokens_saved, the trainer scales verl's MFU to zorro/effective_mfu/<pass>
        self._add_metrics(out, {"zorro/computed_tokens": float(computed), **hooks_missing})
        self.zorro_last_micro_batches = mbs

    def _zorro_count_plan(self, plan: ZorroPlan) -> None:
        """Prefix sharing: add a micro-batch's plan to the tokens run and the deepest tree of the batch."""
        if plan.tree is not None and getattr(self, "_zorro_tree_stats", None) is not None:
            self._zorro_tree_stats[0] += plan.T
            self._zorro_tree_stats[1] = max(self._zorro_tree_stats[1], plan.tree.levels)
