"""The one grouping rule of zorro: rows with identical *valid* prompt tokens form a group. Imports torch only.

Every place that needs groups (the plan, micro-batching in both verl generations, the trainers' DP balancing, the
standalone API) calls :func:`group_ids`, so they can never disagree.
"""

from __future__ import annotations

import torch

__all__ = ["group_ids", "masked_prompts"]

#: Stands in for padding in the grouping key. Token ids are >= 0, so a real token equal to the tokenizer's pad id
#: still counts as a token and cannot collide with padding.
PAD_KEY = -1


def masked_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
    """``prompt_ids [B, Pw] int``, ``prompt_mask [B, Pw] bool`` -> ``[B, Pw] int64`` with pads set to ``-1``."""
    return torch.where(prompt_mask, prompt_ids.long(), torch.full_like(prompt_ids, PAD_KEY, dtype=torch.long))


def group_ids(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
    """Group id of every row, numbered ``0..G-1`` in order of first appearance (rows need not be adjacent).

    Args:
        prompt_ids: ``[B, Pw]`` int — each row's prompt columns (left or right padded: only the valid tokens at
            their columns matter, so callers align valid tokens consistently, e.g. right-aligned).
        prompt_mask: ``[B, Pw]`` bool — True on valid prompt tokens.

    Returns:
        ``[B] int64``. No host sync (``G`` is ``ids.max() + 1``; callers that need it read it with their other
        sizes).
    """
    if prompt_ids.dim() != 2 or prompt_mask.shape != prompt_ids.shape:
        raise ValueError(f"prompt_ids / prompt_mask: expected two [B, Pw] tensors of the same shape, got "
                         f"{tuple(prompt_ids.shape)} and {tuple(prompt_mask.shape)}.")
    B = prompt_ids.shape[0]
    if B == 0:
        return torch.zeros(0, dtype=torch.long, device=prompt_ids.device)
    _, inv = torch.unique(masked_prompts(prompt_ids, prompt_mask), dim=0, return_inverse=True)  # sorted-key ids
    # Renumber by first appearance: the id of a group is the rank of its first row among the groups' first rows.
    ar = torch.arange(B, device=inv.device)
    first = torch.full((B,), B, dtype=torch.long, device=inv.device).scatter_reduce(0, inv, ar, "amin")  # [<=B]
    rank = torch.argsort(first)  # sorted ids in order of first appearance; ids absent from inv sort last
    gid = torch.empty_like(rank)
    gid[rank] = ar
    return gid[inv]
