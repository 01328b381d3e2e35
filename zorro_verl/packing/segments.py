"""Index helpers over segments of the packed row, shared by the plan, the attention backends and the recurrent
layers. Every function works on device tensors without a host sync (sizes are passed in as Python ints).
Imports torch only.
"""

from __future__ import annotations

import torch

__all__ = ["excl_cumsum", "cu_seqlens", "scatter_valid", "segments_to_tokens"]


def excl_cumsum(x: torch.Tensor) -> torch.Tensor:
    """Exclusive prefix sum of a 1-D int64 tensor: ``[a, b, c] -> [0, a, a+b]``."""
    return torch.cumsum(x, 0) - x


def cu_seqlens(lengths: torch.Tensor) -> torch.Tensor:
    """flash-attn ``cu_seqlens``: ``lengths [n] int64 -> [n+1] int32`` with a leading zero."""
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=lengths.device)
    out[1:] = torch.cumsum(lengths, 0).to(torch.int32)
    return out


def scatter_valid(T: int, index: torch.Tensor, valid: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``out [T]`` with ``out[index[valid]] = values[valid]`` without boolean indexing (no host sync): invalid
    entries are written to a dummy slot ``T`` that is cut off."""
    out = torch.zeros(T + 1, dtype=values.dtype, device=values.device)
    out.scatter_(0, torch.where(valid, index, T).flatten(), values.flatten())
    return out[:T]


def segments_to_tokens(starts: torch.Tensor, lengths: torch.Tensor, total: int) -> torch.Tensor:
    """Expand segments into token indices: ``starts [n], lengths [n] int64 -> [total] int64`` =
    ``cat(arange(s, s + l))``; ``total`` must equal ``lengths.sum()`` (a Python int the caller already has)."""
    if total == 0:
        return torch.zeros(0, dtype=torch.long, device=starts.device)
    seg = torch.repeat_interleave(torch.arange(starts.numel(), device=starts.device), lengths, output_size=total)
    local = torch.arange(total, device=starts.device) - excl_cumsum(lengths)[seg]
    return starts[seg] + local
