"""The plan's carrier through megatron-core's ``GPTModel.forward`` (docs/design/megatron.md): a ``PackedSeqParams``
subclass every zorro sequence mixer (core attention, gated delta-net) recognises, and the step's layer-call counter."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from zorro_verl.packing import ZorroPlan
from zorro_verl.packing.context_parallel import CPShard

__all__ = ["ZorroPackedSeqParams", "LayerCallCounter", "ZORRO_QKV_FORMAT"]

#: Megatron reads ``qkv_format == "thd"`` to switch to per-segment (packed) handling; any other value makes it treat
#: the packed row as one sequence, which is what zorro wants (the plan carries the structure).
ZORRO_QKV_FORMAT = "sbhd"


class LayerCallCounter:
    """How many sequence-mixer calls took the zorro path in one forward (checked by the step: a layer that did not
    reach zorro would have attended over the whole packed row, silently wrong). Opaque on purpose: it is shared by
    reference however the params object is copied."""

    __slots__ = ("count",)

    def __init__(self):
        self.count = 0


@dataclasses.dataclass
class ZorroPackedSeqParams(PackedSeqParams):
    """``PackedSeqParams`` that carries a zorro plan through ``GPTModel.forward`` to every core attention.

    Build it with :meth:`for_plan`. ``qkv_format`` must stay ``"sbhd"`` and ``max_seqlen_q`` / ``max_seqlen_kv`` must
    be at least the largest position + 1 (``plan.max_row_len``): megatron sizes its RoPE table from them.

    Fields beyond megatron's: ``plan`` (the micro-batch's :class:`~zorro_verl.packing.ZorroPlan`), ``backend`` (a
    registered attention backend name), ``padded_len`` (tokens of the row the model runs: ``plan.T`` plus padding to
    a multiple of the tensor-parallel size under sequence parallelism; pad tokens attend to nothing and output 0),
    ``calls`` (the step's :class:`LayerCallCounter`), ``position_ids`` (``[padded_len] int64``, each token's position
    in its ordinary row, 0 on pad tokens: multi-latent attention's RoPE, :class:`ZorroMLA`), ``cp`` (under context
    parallelism: this rank's :class:`~zorro_verl.packing.context_parallel.CPShard`; the model then runs the shard's
    ``L = padded_len`` tokens and the core attention all-gathers keys / values over the CP group).
    """

    plan: Optional[ZorroPlan] = None
    backend: str = "sdpa"
    padded_len: int = 0
    calls: Optional[LayerCallCounter] = None
    position_ids: Optional[torch.Tensor] = None
    cp: Optional[CPShard] = None

    @classmethod
    def for_plan(cls, plan: ZorroPlan, backend: str, padded_len: int,
                 cp: Optional[CPShard] = None) -> "ZorroPackedSeqParams":
        if cp is not None:
            if padded_len != cp.local_len:
                raise ValueError(f"padded_len: expected the CP shard's length {cp.local_len}, got {padded_len}.")
            return cls(qkv_format=ZORRO_QKV_FORMAT, max_seqlen_q=plan.max_row_len, max_seqlen_kv=plan.max_row_len,
                       plan=plan, backend=backend, padded_len=padded_len, calls=LayerCallCounter(),
                       position_ids=cp.position_ids, cp=cp)
        if padded_len < plan.T:
            raise ValueError(f"padded_len: expected >= plan.T ({plan.T}), got {padded_len}.")
        pos = plan.position_ids
        if padded_len > plan.T:  # pad tokens at position 0 (they attend to nothing and are never read)
            pos = torch.cat([pos, pos.new_zeros(padded_len - plan.T)])
        return cls(qkv_format=ZORRO_QKV_FORMAT, max_seqlen_q=plan.max_row_len, max_seqlen_kv=plan.max_row_len,
                   plan=plan, backend=backend, padded_len=padded_len, calls=LayerCallCounter(), position_ids=pos)
