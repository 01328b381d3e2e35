"""The reference API's static packing helpers, ``ZoRRoTrain``, and ``ReconstructionInfo`` (docs/design/api.md).
Torch only. Every helper is a thin view of the one :class:`~zorro_verl.packing.ZorroPlan` built per micro-batch.

Packed order of response tokens ("packed"): groups in order of first appearance, responses of a group in row
order — the order they have in the packed dedup row. Original order: rows in batch order, valid tokens only.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from zorro_verl.packing import ZorroPlan, build_plan
from zorro_verl.packing.flash_params import flash_params_from_attention_mask, flash_params_from_padding_mask

__all__ = ["ReconstructionInfo", "ZoRRoTrain"]


class ReconstructionInfo(dict):
    """Ensures object identity persists; forces use of update() to overwrite contents.

    New keys may be set with ``info[key] = value``; overwriting an existing key that way raises ``KeyError`` (call
    ``info.update(key=value)``), so a stale plan is never half-replaced by accident.
    """

    def __setitem__(self, key, value):
        if key in self:
            raise KeyError(f"ReconstructionInfo[{key!r}] already set; use .update({key}=...) to overwrite it.")
        super().__setitem__(key, value)

    def update(self, *args, **kwargs):  # noqa: D401 - dict.update semantics, in place
        for k, v in dict(*args, **kwargs).items():
            dict.__setitem__(self, k, v)


def _plan_of(reconstruction_info) -> ZorroPlan:
    if not isinstance(reconstruction_info, dict) or not isinstance(reconstruction_info.get("plan"), ZorroPlan):
        raise TypeError("reconstruction_info: expected the ReconstructionInfo returned by "
                        f"ZoRRoTrain.create_deduplicated_batch, got {type(reconstruction_info).__name__}.")
    return reconstruction_info["plan"]


def _as_packed(x: torch.Tensor, info: dict, name: str) -> torch.Tensor:
    """Accept ``[1, T, ...]``/``[T, ...]`` (unpadded) or ``[G, Lg, ...]`` (padded per group) -> ``[T, ...]``."""
    plan = _plan_of(info)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}.")
    if x.dim() >= 1 and x.shape[0] == plan.T and not (x.dim() >= 2 and x.shape[0] == 1 and x.shape[1] == plan.T):
        return x
    if x.dim() >= 2 and x.shape[0] == 1 and x.shape[1] == plan.T:
        return x[0]
    gi = info.get("group_index")
    if gi is not None and x.dim() >= 2 and tuple(x.shape[:2]) == tuple(gi.shape):
        flat = x.reshape(-1, *x.shape[2:])
        return flat[info["group_token_flat"]]
    raise ValueError(f"{name}: expected [1, T={plan.T}, ...], [T, ...] or the padded per-group layout "
                     f"{tuple(gi.shape) if gi is not None else '[G, Lg]'}, got {tuple(x.shape)}.")


class ZoRRoTrain:
    """Static helpers of the reference API (grouping, dedup batch, reconstruction, flash-attn params)."""

    @staticmethod
    def find_prompt_groups(input_ids: torch.Tensor, response_length: int,
                           attention_mask: Optional[torch.Tensor] = None) -> Tuple[List[List[int]], torch.Tensor]:
        """Group rows with identical prompts.

        Args:
            input_ids: ``[B, S] int64`` — prompt ``[:, :S-R]`` + response ``[:, S-R:]``.
            response_length: ``R``.
            attention_mask: optional ``[B, S]`` 0/1; when given, groups by *valid* prompt tokens (pads ignored,
                a real token equal to the pad id still counts).

        Returns:
            ``(prompt_groups, unique_prompts)``: row indices of each group (groups in order of first appearance,
            rows in batch order; siblings need not be adjacent) and ``[G, S-R] int64`` — each group's prompt
            columns as in its first row.
        """
        plan = build_plan(input_ids, attention_mask, response_length)
        return plan.groups(), input_ids[plan.group_rep_row, : input_ids.shape[1] - response_length]

    @staticmethod
    def create_deduplicated_batch(
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        response_length: int,
        prompt_groups: List[List[int]],
        unique_prompts: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        use_unpad: bool = False,
    ) -> Tuple[torch.Tensor, torch.Tensor, Dict]:
        """Build the deduplicated batch: each group as ``[prompt | response_1 | response_2 | ...]``.

        Args:
            input_ids: ``[B, S] int64``; position_ids: ``[B, S] int64`` (verl convention; checked on valid tokens);
            response_length: ``R``; prompt_groups / unique_prompts: from :meth:`find_prompt_groups` (checked
            against the grouping of ``input_ids``; a mismatch raises); attention_mask: optional ``[B, S]`` 0/1.
            use_unpad: ``True`` -> one packed row ``[1, T]``; ``False`` -> one row per group ``[G, Lg]`` right
            padded with 0 (pads: id 0, position 0).

        Returns:
            ``(dedup_ids, dedup_pos, reconstruction_info)`` — the info holds the plan and layout for the other
            helpers (and ``ZorroPlan`` for :func:`~zorro_verl.integrations.transformers.zorro_forward`).
        """
        plan = build_plan(input_ids, attention_mask, response_length, position_ids=position_ids)
        got = [list(map(int, g)) for g in prompt_groups] if isinstance(prompt_groups, (list, tuple)) else None
        if got is None:
            raise TypeError(f"prompt_groups: expected a list of row-index lists, got {type(prompt_groups).__name__}.")
        if sorted(sorted(g) for g in got) != sorted(plan.groups()):
            raise ValueError("prompt_groups: does not match the grouping of input_ids by valid prompt tokens "
                             f"(expected {plan.groups()}, got {got}). Recompute it with "
                             "ZoRRoTrain.find_prompt_groups(input_ids, response_length, attention_mask).")
        if not isinstance(unique_prompts, torch.Tensor) or unique_prompts.shape[0] != plan.G:
            raise ValueError(f"unique_prompts: expected a tensor with one row per group ({plan.G}), got "
                             f"{getattr(unique_prompts, 'shape', type(unique_prompts).__name__)}.")
        info = ReconstructionInfo(plan=plan, use_unpad=bool(use_unpad), response_length=response_length,
                                  prompt_groups=plan.groups(), shape=tuple(input_ids.shape))
        if use_unpad:
            return plan.input_ids[None], plan.position_ids[None], info
        # Per-group rows: a group's tokens are contiguous in the packed row.
        dev = plan.device
        seg_sum = torch.zeros(plan.G, dtype=torch.long, device=dev).index_add_(0, plan.row_group, plan.response_lens)
        glen = plan.prompt_lens + seg_sum  # [G]
        lmax = int(glen.max())
        ar = torch.arange(lmax, device=dev)[None, :]
        valid = ar < glen[:, None]  # [G, Lg]
        group_index = torch.where(valid, plan.prompt_start[:, None] + ar, 0)
        flat_valid = torch.arange(plan.G * lmax, device=dev).view(plan.G, lmax)[valid]  # packed order
        info.update(group_index=group_index, group_valid=valid, group_token_flat=flat_valid)
        ids = torch.where(valid, plan.input_ids[group_index], 0)
        pos = torch.where(valid, plan.position_ids[group_index], 0)
        return ids, pos, info

    @staticmethod
    def reconstruct_sequences(dedup_hidden: torch.Tensor, reconstruction_info: Dict) -> torch.Tensor:
        """Expand dedup values back to the verl batch: ``[1, T, ...]`` (or ``[G, Lg, ...]``) -> ``[B, S, ...]``,
        every row getting a copy of its prompt; zeros on pads."""
        plan = _plan_of(reconstruction_info)
        x = _as_packed(dedup_hidden, reconstruction_info, "dedup_hidden")  # [T, ...]
        fi = plan.full_index()  # [B, S]
        out = x[fi.clamp(min=0)]
        keep = (fi >= 0).view(*fi.shape, *([1] * (x.dim() - 1)))
        return torch.where(keep, out, torch.zeros((), dtype=out.dtype, device=out.device))

    @staticmethod
    def deduplicate_sequences(full_hidden: torch.Tensor, reconstruction_info: Dict) -> torch.Tensor:
        """Inverse of :meth:`reconstruct_sequences`: ``[B, S, ...] -> [1, T, ...]`` (``[G, Lg, ...]`` if the batch
        was built with ``use_unpad=False``); a prompt is read from its group's first row."""
        plan = _plan_of(reconstruction_info)
        if not isinstance(full_hidden, torch.Tensor) or tuple(full_hidden.shape[:2]) != (plan.B, plan.S):
            raise ValueError(f"full_hidden: expected shape [B={plan.B}, S={plan.S}, ...], got "
                             f"{tuple(getattr(full_hidden, 'shape', ()))}.")
        packed = full_hidden.reshape(plan.B * plan.S, *full_hidden.shape[2:])[plan.source_index]  # [T, ...]
        if reconstruction_info.get("use_unpad", True):
            return packed[None]
        gi, valid = reconstruction_info["group_index"], reconstruction_info["group_valid"]
        out = packed[gi]
        keep = valid.view(*valid.shape, *([1] * (packed.dim() - 1)))
        return torch.where(keep, out, torch.zeros((), dtype=out.dtype, device=out.device))

    @staticmethod
    def extract_unpadded_responses_from_deduped_packed_ids(packed_ids: torch.Tensor, reconstruction_info: Dict,
                                                           offset: int = 0) -> torch.Tensor:
        """Values at the valid response tokens of the packed row, packed order -> ``[N, ...]``.

        ``offset=0``: the response tokens themselves. ``offset=-1``: the rows that *predict* them (the last prompt
        token for each response's first token — read once per response, never by rolling the packed row).
        """
        plan = _plan_of(reconstruction_info)
        if offset not in (0, -1):
            raise ValueError(f"offset: expected 0 (response tokens) or -1 (their predicting rows), got {offset!r}.")
        x = _as_packed(packed_ids, reconstruction_info, "packed_ids")
        pos = plan.response_positions() if offset == 0 else plan.logit_index  # original order
        return x[pos[plan.packed_response_order()]]

    @staticmethod
    def responses_in_orig_sample_order(packed_responses: torch.Tensor, reconstruction_info: Dict) -> torch.Tensor:
        """Reorder ``[N, ...]`` values from packed order to original row order."""
        plan = _plan_of(reconstruction_info)
        if not isinstance(packed_responses, torch.Tensor) or packed_responses.shape[0] != plan.N:
            raise ValueError(f"packed_responses: expected [N={plan.N}, ...] (valid response tokens), got "
                             f"{tuple(getattr(packed_responses, 'shape', ()))}.")
        out = torch.empty_like(packed_responses)
        out[plan.packed_response_order()] = packed_responses
        return out

    @staticmethod
    def attention_mask_to_flash_attn_params(attention_mask: Optional[torch.Tensor] = None,
                                            device: torch.device = None, *,
                                            padding_mask: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
        """flash-attn varlen parameters of a block-causal self-attention mask.

        Args:
            attention_mask: ``[q, k]`` (also ``[1, q, k]`` or ``[1, 1, q, k]``) bool / 0-1 — True where a query may
                attend a key — made of block-causal blocks along the diagonal, possibly bottom-right aligned (see
                :func:`~zorro_verl.packing.flash_params.flash_params_from_attention_mask`). Anything else raises.
            device: where the returned ``cu_seqlens`` live (default: the mask's device).
            padding_mask: instead of ``attention_mask``, a ``[n, L]`` 0/1 padding mask — one sequence per row, its
                valid-token count is its length. Exactly one of the two must be given.

        Returns:
            ``cu_seqlens_q``/``cu_seqlens_k`` ``[n+1] int32``, ``max_seqlen_q``/``max_seqlen_k`` and
            ``num_sequences`` (Python ints, flash-attn vocabulary). Example: three sequences of 5, 3 and 4 tokens as a
            12 x 12 block-causal mask give ``cu_seqlens_q = [0, 5, 8, 12]``.
        """
        if (attention_mask is None) == (padding_mask is None):
            raise ValueError("attention_mask / padding_mask: expected exactly one of them — a [q, k] block-causal "
                             "self-attention mask as attention_mask, or an [n, L] padding mask as padding_mask=.")
        if padding_mask is not None:
            return flash_params_from_padding_mask(padding_mask, device)
        return flash_params_from_attention_mask(attention_mask, device)
