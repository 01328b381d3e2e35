"""The Megatron critic (value model) for the zorro value tests (tests/integrations/megatron/test_value_engine.py; never
shipped): an fp64 ``GPTModel`` whose ``output_layer`` is a value head as verl's Megatron critic builds it, megatron's
ordinary forward of it and zorro's value step on the same batch, with the same test loss.

:class:`Fp64ValueHead` is verl's / Megatron-Bridge's ``LinearForLastLayer`` (``Linear(H, 1)`` without bias, weight
marked ``sequence_parallel`` under SP, output all-gathered over the sequence) without its cast of the output to fp32,
which would round an fp64 comparison to fp32; the engine tests (fp32) run the real one.
"""

from __future__ import annotations

import torch

from tests.support import megatron_cpu as M

__all__ = ["Fp64ValueHead", "value_gpt", "stock_values", "zorro_values_of", "compare_values", "value_loss"]


class Fp64ValueHead(torch.nn.Linear):
    """``LinearForLastLayer`` (Megatron-Bridge's ``train_utils``) in the model's precision: ``[s(/tp), b, H]`` ->
    ``([s, b, 1], None)``."""

    def __init__(self, hidden: int, sequence_parallel: bool):
        super().__init__(hidden, 1, bias=False, dtype=torch.float64)
        self.sequence_parallel = sequence_parallel
        if sequence_parallel:
            self.weight.sequence_parallel = True

    def forward(self, input_, weight=None, runtime_gather_output=None):
        from megatron.core import tensor_parallel

        out = super().forward(input_)
        if self.sequence_parallel:
            out = tensor_parallel.gather_from_sequence_parallel_region(out, tensor_parallel_output_grad=False)
        return out, None


def value_gpt(*, zorro: bool, sequence_parallel: bool = False, seed: int = 0):
    """:func:`tests.support.megatron_cpu.build_gpt`'s tiny fp64 GPT with its LM head replaced by an
    :class:`Fp64ValueHead` drawn from ``seed + 1`` (the same weights on every rank and for both models)."""
    model = M.build_gpt(zorro=zorro, sequence_parallel=sequence_parallel, parallel_output=False, seed=seed)
    torch.manual_seed(seed + 1)
    model.output_layer = Fp64ValueHead(model.config.hidden_size, bool(model.config.sequence_parallel))
    return model


def value_loss(v: torch.Tensor) -> torch.Tensor:
    """The test loss on values ``[N]`` fp64: unequal per-token weights plus a square term (a non-constant gradient)."""
    return (v * M.loss_weights(v.numel())).sum() + 0.5 * (v * v).sum()


def stock_values(model, ids, am, R, tp_multiple: int = 1) -> torch.Tensor:
    """Megatron's ordinary forward of the value model on the right-padded rows (``L`` a multiple of
    ``tp_multiple``), causal mask, megatron's ``DotProductAttention``: the values at every position that predicts a
    response token (row ``b``'s ``[p_b - 1, p_b + r_b - 1)``, where verl reads a critic's values) ``[N]``, detached;
    the test loss's gradients are left in ``model``."""
    rows = M._rows(ids, am, R)
    L = max(len(t) for t, _, _ in rows)
    L = -(-L // tp_multiple) * tp_multiple
    batch = torch.zeros(len(rows), L, dtype=torch.long)
    for b, (t, _, _) in enumerate(rows):
        batch[b, :len(t)] = t
    mask = torch.triu(torch.ones(L, L, dtype=torch.bool), 1).view(1, 1, L, L)
    out = model(input_ids=batch, position_ids=torch.arange(L)[None].expand(len(rows), L), attention_mask=mask)
    v = torch.cat([out[b, p - 1:p + r - 1, 0] for b, (_, p, r) in enumerate(rows) if r > 0])  # out [B, L, 1]
    value_loss(v).backward()
    return v.detach()


def zorro_values_of(model, ids, am, R, sharing: str = "prompt"):
    """zorro's value step on the same batch and loss: ``(values [N], plan)``."""
    from zorro_verl.integrations.megatron import zorro_gpt_forward, zorro_gpt_values
    from zorro_verl.packing import build_plan

    plan = build_plan(ids, am, R, sharing=sharing, **({"min_shared_len": 1} if sharing == "prefix" else {}))
    v = zorro_gpt_values(model, plan, zorro_gpt_forward(model, plan, value_head=True))
    value_loss(v).backward()
    return v.detach(), plan


def compare_values(stock: torch.Tensor, zorro: torch.Tensor, g_stock: dict, g_zorro: dict) -> dict:
    """Max abs value difference, the values' scale and the max over parameters of ``max|dg| / max|g_stock|``
    (gradients by :func:`tests.support.megatron_cpu.grads`: sequence-parallel ones summed over TP)."""
    assert g_stock.keys() == g_zorro.keys()
    rel = max(((g_zorro[n] - g_stock[n]).abs().max() / g_stock[n].abs().max().clamp_min(1e-300)).item()
              for n in g_stock)
    return {"values": (zorro - stock).abs().max().item(), "scale": stock.abs().max().item(), "grad_rel": rel,
            "n": int(stock.numel()), "params": len(g_stock), "dtype": str(zorro.dtype)}
