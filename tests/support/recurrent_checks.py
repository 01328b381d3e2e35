"""Shared checks of the recurrent-layer model tests (gated delta-nets, Mamba, LFM2 convs, lightning attention):
gradients of a fixed scalar of log-probs and entropy, the ordinary per-row oracle, and the fp32 relative rule
(docs/design/testing.md: zorro's fp32 error vs an fp64 run at most 2x the ordinary forward's own for log-probs and
entropy, 3x for gradients)."""

from __future__ import annotations

import torch

from zorro_verl.integrations.transformers import install_zorro, zorro_step
from zorro_verl.packing import build_plan
from zorro_verl.testing import grads_of, max_rel_grad_error, ordinary_logprobs

#: fp64: zorro vs the per-row oracle, log-probs / entropy absolute and every parameter's gradient relative
LP_ABS_TOL = 1e-12
GRAD_REL_TOL = 1e-12

__all__ = ["one_thread", "grads", "oracle", "assert_exact_fp64", "assert_relative_rule"]


def one_thread():
    """Generator for an autouse fixture: tiny tensors run faster on one intra-op thread and do not spin on a shared,
    busy machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def grads(model, lp: torch.Tensor, ent: torch.Tensor) -> dict:
    """Parameter gradients of ``lp.sum() + 0.3 * ent.sum()`` (entropy weighted so its gradient path counts
    separately); ``lp``, ``ent``: ``[B, R]``."""
    model.zero_grad(set_to_none=True)
    (lp.sum() + 0.3 * ent.sum()).backward()
    return grads_of(model)


def oracle(model, batch: dict, R: int) -> tuple:
    """The ordinary per-row forward of ``batch`` (``input_ids`` / ``attention_mask [B, S]``): detached log-probs and
    entropy ``[B, R]`` and the gradients of :func:`grads`."""
    lp, ent = ordinary_logprobs(model, batch["input_ids"], batch["attention_mask"], R, calculate_entropy=True)
    return lp.detach(), ent.detach(), grads(model, lp, ent)


def assert_exact_fp64(model, plan, lp_ref: torch.Tensor, ent_ref: torch.Tensor, g_ref: dict, calls=None) -> None:
    """zorro's step on ``plan`` (fp64 ``model``, zorro installed) equals the oracle's ``lp_ref`` / ``ent_ref [B, R]``
    within :data:`LP_ABS_TOL` and every parameter's gradient (each nonzero: every parameter matters) within
    :data:`GRAD_REL_TOL` relative; ``calls`` is passed to ``zorro_step`` (the layer-call check)."""
    lp, ent = zorro_step(model, plan, calculate_entropy=True, calls=calls)
    g_z = grads(model, lp, ent)
    assert (lp - lp_ref).abs().max().item() < LP_ABS_TOL
    assert (ent - ent_ref).abs().max().item() < LP_ABS_TOL
    assert set(g_z) == set(g_ref) and len(g_ref) == len(list(model.parameters()))
    for name, ref in g_ref.items():
        assert ref.abs().max().item() > 0, name
        err, _ = max_rel_grad_error({name: ref}, {name: g_z[name]})
        assert err <= GRAD_REL_TOL, (name, err)


def assert_relative_rule(m32, m64, batch: dict, R: int) -> None:
    """fp32 zorro (``m32``, zorro installed here) vs the ordinary fp32 forward, both measured against the fp64 oracle
    ``m64`` (the same weights, its fp32 casts made exact): log-probs / entropy within 2x, gradients within 3x of the
    ordinary forward's own error; the ordinary error must be nonzero and small (the fp64 oracle computes the stock
    model's function)."""
    lp64, ent64, g64 = oracle(m64, batch, R)
    lp_o, ent_o, g_o = oracle(m32, batch, R)
    install_zorro(m32)
    lp_z, ent_z = zorro_step(m32, build_plan(batch["input_ids"], batch["attention_mask"], R), calculate_entropy=True)
    g_z = grads(m32, lp_z, ent_z)
    up = lambda g: {n: t.double() for n, t in g.items()}  # noqa: E731
    ref_lp, z_lp = (lp_o.double() - lp64).abs().max().item(), (lp_z.double() - lp64).abs().max().item()
    ref_ent, z_ent = (ent_o.double() - ent64).abs().max().item(), (ent_z.double() - ent64).abs().max().item()
    ref_g, z_g = max_rel_grad_error(g64, up(g_o))[0], max_rel_grad_error(g64, up(g_z))[0]
    assert 0 < ref_lp < 1e-5 and 0 < ref_ent < 1e-5
    assert z_lp <= 2 * ref_lp and z_ent <= 2 * ref_ent, (z_lp, ref_lp, z_ent, ref_ent)
    assert z_g <= 3 * ref_g, (z_g, ref_g)
