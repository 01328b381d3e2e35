"""The context-parallel benchmark row (docs/design/megatron.md "Context parallelism"): per CP rank, the tokens each
side runs, the keys / values it all-gathers, and the FLOP model's cost, zorro vs stock CP on the same rows.

Stock: verl's THD layout (each ordinary row ``P_b + r_b`` padded to a multiple of ``2 tp cp``, ``1 / cp`` of it per
rank, zigzag: causal costs balanced), Transformer Engine's CP attention passing each rank's ``k`` / ``v`` chunk
``cp - 1`` times. Zorro: the packed row (each prompt once) split by
:func:`~zorro_verl.packing.context_parallel.cp_split`, the keys / values all-gathered. Counted from the lengths
alone (no model runs): tokens and bytes exactly as the code moves them; FLOPs with :mod:`.flops`' per-token and
per-pair costs — ``ideal`` is the causal share (a rank's pairs = the sum of ``p + 1`` over its tokens), which the
varlen CP attention (``flash_copyfree`` / ``flash``) computes, ``dense`` what the dense CP call (``sdpa`` /
``eager``) computes (every local query against all ``T`` keys, masked).
"""

from __future__ import annotations

import torch

from zorro_verl.bench.flops import layer_costs
from zorro_verl.packing.context_parallel import cp_costs, cp_kv_bytes, cp_split, stock_cp_local_tokens

__all__ = ["packed_positions", "cp_bench_row"]


def packed_positions(p_len: torch.Tensor, r_len: torch.Tensor, row_group: torch.Tensor) -> torch.Tensor:
    """The packed row's positions ``[T] int64`` from per-row lengths (``[B] int64`` each): groups in order of first
    appearance, each prompt ``0..P-1`` once, then its rows' responses ``P..P+r-1`` in row order (the plan's
    layout)."""
    parts = []
    order = []
    for g in row_group.tolist():
        if g not in order:
            order.append(g)
    for g in order:
        rows = (row_group == g).nonzero().flatten().tolist()
        P = int(p_len[rows[0]])
        parts.append(torch.arange(P))
        parts += [torch.arange(P, P + int(r_len[b])) for b in rows]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def cp_bench_row(cfg, p_len: torch.Tensor, r_len: torch.Tensor, row_group: torch.Tensor, cp: int, tp: int = 1,
                 element_size: int = 2) -> dict:
    """Per-rank figures of one micro-batch under CP.

    Args:
        cfg: model dimensions (:func:`~zorro_verl.bench.flops.layer_costs`; ``num_key_value_heads``, ``head_dim``).
        p_len, r_len, row_group: ``[B] int64`` valid prompt / response length and group id per row.
        cp: the CP size; tp: the TP size (key / value heads per rank ``Hkv / tp``; the slices a multiple of ``tp``
            under sequence parallelism); element_size: bytes per element of k / v (2: bf16).

    Returns:
        dict of ints / floats: ``stock_tokens`` / ``zorro_tokens`` (per rank, padding included), ``stock_kv_bytes``
        / ``zorro_kv_bytes`` (per rank, all layers, forward; the backward moves as much again), ``stock_pairs`` /
        ``zorro_pairs_ideal`` / ``zorro_pairs_dense`` (attention (query, key) pairs of the costliest rank, per head
        and layer), ``stock_flops`` / ``zorro_flops_ideal`` / ``zorro_flops_dense`` (forward FLOPs of the costliest
        rank: linear per token + attention per pair; the head left out), ``ideal_speedup`` and ``dense_speedup``
        (stock / zorro FLOPs), ``T`` (packed tokens), ``ordinary_tokens``.
    """
    L_layers, per_token, per_pair = layer_costs(cfg)
    hkv = cfg.num_key_value_heads // tp
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    seq = (p_len + r_len).tolist()
    # stock: each row padded to 2 tp cp, 1/cp of it per rank; zigzag balances the causal pairs of the padded rows
    s_tokens = stock_cp_local_tokens(seq, cp, tp)
    align = tp * cp * (2 if cp > 1 else 1)
    padded = [-(-n // align) * align for n in seq]
    s_pairs = -(-sum(n * (n + 1) // 2 for n in padded) // cp)
    # zorro: the packed row split by cp_split (a multiple of tp under SP)
    pos = packed_positions(p_len, r_len, row_group)
    index = cp_split(pos, cp, tp)
    z_tokens, T = index.shape[1], pos.numel()
    z_ideal = int(cp_costs(pos, index).max())
    z_dense = z_tokens * T
    s_flops = per_token * s_tokens + L_layers * per_pair * s_pairs
    z_ideal_flops = per_token * z_tokens + L_layers * per_pair * z_ideal
    z_dense_flops = per_token * z_tokens + L_layers * per_pair * z_dense
    return {"stock_tokens": s_tokens, "zorro_tokens": z_tokens,
            "stock_kv_bytes": L_layers * cp_kv_bytes(s_tokens, cp, hkv, D, element_size),
            "zorro_kv_bytes": L_layers * cp_kv_bytes(z_tokens, cp, hkv, D, element_size),
            "stock_pairs": s_pairs, "zorro_pairs_ideal": z_ideal, "zorro_pairs_dense": z_dense,
            "stock_flops": s_flops, "zorro_flops_ideal": z_ideal_flops, "zorro_flops_dense": z_dense_flops,
            "ideal_speedup": s_flops / z_ideal_flops, "dense_speedup": s_flops / z_dense_flops,
            "T": T, "ordinary_tokens": int(sum(seq))}
