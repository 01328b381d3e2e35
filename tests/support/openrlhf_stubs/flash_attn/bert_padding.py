"""Test stand-in for ``flash_attn.bert_padding`` (flash-attn 2.8): the same functions in plain torch.

``unpad_input(hidden [B, S, ...], attention_mask [B, S], unused_mask=None)`` ->
``(hidden[valid] [nnz, ...], indices [nnz] int64, cu_seqlens [B+1] int32, max_seqlen int, used_seqlens [B] int32)``;
``pad_input(hidden [nnz, ...], indices, batch, seqlen)`` -> ``[batch, seqlen, ...]`` with zeros on pads;
``index_first_axis(x [n, ...], indices)`` -> ``x[indices]``. Indexing is differentiable in torch, so no custom
autograd Functions are needed (flash-attn's exist for speed only).
"""

import torch
import torch.nn.functional as F
from einops import rearrange  # noqa: F401  (re-exported, as flash-attn does)


def index_first_axis(x, indices):
    return x[indices]


def index_put_first_axis(values, indices, first_axis_dim):
    out = values.new_zeros((first_axis_dim, *values.shape[1:]))
    return out.index_put((indices,), values)


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    all_masks = (attention_mask + unused_mask) if unused_mask is not None else attention_mask
    seqlens_in_batch = all_masks.sum(dim=-1, dtype=torch.int32)
    used_seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = seqlens_in_batch.max().item()
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return index_first_axis(flat, indices), indices, cu_seqlens, max_seqlen_in_batch, used_seqlens_in_batch


def pad_input(hidden_states, indices, batch, seqlen):
    out = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])
