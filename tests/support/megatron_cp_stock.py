"""A CPU stand-in for Transformer Engine's context-parallel attention, so that verl's **stock** Megatron engine runs
at CP > 1 on the CPU (megatron's local ``DotProductAttention`` has no CP exchange and refuses packed sequences; TE
does both). Test support only, never shipped.

What it reproduces: the core-attention call megatron's ``SelfAttention`` makes on verl's packed (THD) path,
``forward(query [t, Hq, D], key / value [t, Hkv, D], attention_mask=None, attn_mask_type=causal,
packed_seq_params=<thd>)`` -> ``[t, Hq * D]``, where ``t`` is this rank's share of verl's THD buffer
(``verl.models.mcore.util.preprocess_thd_engine``): every row padded to ``cu_seqlens_q_padded`` (a multiple of
``2 tp cp``), each rank holding ``1 / cp`` of each row as two chunks, ``r`` and ``2 cp - 1 - r`` of its ``2 cp``
(the zigzag). As TE's ``all_gather`` CP communication type does, the keys / values of the ``t`` local tokens are
all-gathered over the CP group (:func:`zorro_verl.attention.context_parallel` 's autograd-aware gather: the backward
sums every rank's ``dk`` / ``dv`` into their owner); each row's keys are put back in order and each local chunk
attends causally to its row's keys up to its own end (one varlen flash call, bottom-right aligned causal masks, on
PyTorch's CPU kernels: zorro's :func:`~zorro_verl.attention.primitives.varlen_attention`). The padded tail of a row
sees only itself and what precedes it; verl drops its outputs. ``CP = 1``: each row alone.

It is a plain ``torch.nn.Module`` built with megatron's core-attention arguments (so zorro's mixer, placed in front
of it by :func:`zorro_verl.integrations.megatron.zorro_layer_spec`, takes its zorro calls and leaves it the stock
ones). :data:`GATHERED_BYTES` counts the bytes each call's all-gather receives (the long-context benchmark's CP
column). Checked against verl's stock engine at CP = 1 (tests/integrations/megatron/test_engine_cp.py).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from zorro_verl.attention.primitives import cpu_flash_primitives, varlen_attention

__all__ = ["ThdCpCoreAttention", "GATHERED_BYTES", "with_stock_cp_attention"]

#: Bytes received by this process's all-gathers, appended per call (cleared by the caller).
GATHERED_BYTES: list[int] = []


class ThdCpCoreAttention(torch.nn.Module):
    """Stock CP attention on verl's THD layout (module docstring)."""

    def __init__(self, config, layer_number=None, attn_mask_type=None, attention_type=None, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, **kwargs):
        super().__init__()
        self.config = config
        self.softmax_scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.pg_collection = pg_collection

    def _cp_group(self):
        cp = getattr(self.pg_collection, "cp", None)
        if cp is not None:
            return cp
        from megatron.core import parallel_state

        return parallel_state.get_context_parallel_group()

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            raise ValueError("ThdCpCoreAttention (CPU stand-in of TE's CP attention): expected verl's packed THD call "
                             "(packed_seq_params with qkv_format='thd')")
        if attention_mask is not None or attention_bias is not None:
            raise ValueError("ThdCpCoreAttention: expected no attention_mask / attention_bias on the THD path")
        group = self._cp_group()
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        cu = packed_seq_params.cu_seqlens_q_padded
        if cu is None:
            cu = packed_seq_params.cu_seqlens_q
        cu = [int(c) for c in cu.tolist()]
        t, hq, d = query.shape
        hkv, dv = key.shape[1], value.shape[2]
        kv = torch.cat([key.reshape(t, hkv * d), value.reshape(t, hkv * dv)], 1)
        if cp > 1:
            from zorro_verl.attention.context_parallel import _GatherKV

            GATHERED_BYTES.append(kv.numel() * kv.element_size() * (cp - 1))
            kv = _GatherKV.apply(kv, group)  # [cp * t, F], rank-major
        # one varlen call: each local chunk of a row (queries) against its row's keys up to the chunk's end,
        # causal bottom-right aligned (a chunk at offset a of its row sees keys [0, a + i]), as TE's kernels compute
        q_chunks, k_rows = [], []
        for i in range(len(cu) - 1):
            S = cu[i + 1] - cu[i]
            n, start = S // cp, cu[i] // cp  # this row's tokens on each rank, and where they start in its buffer
            if cp == 1:
                q_chunks.append((start, n))
                k_rows.append(torch.arange(start, start + S))
                continue
            half = n // 2
            # chunk j of the row: on rank j (front half) for j < cp, on rank 2cp-1-j (back half) otherwise
            order = torch.cat([torch.arange(half) + (j if j < cp else 2 * cp - 1 - j) * t + start
                               + (0 if j < cp else half) for j in range(2 * cp)])  # [S]: the row's keys in order
            for off, j in ((0, rank), (half, 2 * cp - 1 - rank)):
                q_chunks.append((start + off, half))
                k_rows.append(order[: (j + 1) * half])
        q_idx = torch.cat([torch.arange(a, a + n) for a, n in q_chunks]).to(query.device)
        k_idx = torch.cat(k_rows).to(kv.device)
        cu_q = _cu([n for _, n in q_chunks])
        cu_k = _cu([int(k.numel()) for k in k_rows])
        k_sel = kv.index_select(0, k_idx)
        out = varlen_attention(query.index_select(0, q_idx), k_sel[:, :hkv * d].view(-1, hkv, d),
                               k_sel[:, hkv * d:].view(-1, hkv, dv), cu_q, cu_k,
                               max(n for _, n in q_chunks), max(int(k.numel()) for k in k_rows), self.softmax_scale,
                               True, cpu_flash_primitives())  # [t, Hq, Dv] in q_idx order
        return out.new_zeros(t, hq, dv).index_copy(0, q_idx, out).reshape(t, hq * dv)


def _cu(lens: list) -> torch.Tensor:
    return torch.tensor([0, *lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)


def with_stock_cp_attention(spec):
    """A copy of a layer spec (megatron's local one) with :class:`ThdCpCoreAttention` as its core attention (then
    wrapped by zorro's mixer as any core attention is)."""
    import dataclasses

    attn = spec.submodules.self_attention
    sub = dataclasses.replace(attn.submodules, core_attention=ThdCpCoreAttention)
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules,
                                                                    self_attention=dataclasses.replace(attn,
                                                                                                       submodules=sub)))
