"""Error measures between the gradients (or outputs) of the ordinary forward and zorro's."""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["grads_of", "max_rel_grad_error", "grad_rel_error"]


def grads_of(model) -> dict[str, torch.Tensor]:
    """``{name: grad.clone()}`` of every parameter that has a gradient."""
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def max_rel_grad_error(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor],
                       floor: Optional[float] = None) -> tuple[float, str]:
    """Largest per-tensor relative error ``max|got - ref| / max|ref|`` over all parameters, and its name.

    Every reference gradient must be present in ``got``. ``floor`` (default: the tensor's dtype eps) keeps an
    all-zero reference gradient from dividing by zero.
    """
    missing = sorted(set(ref) ^ set(got))
    if missing:
        raise AssertionError(f"gradients present in only one model: {missing[:5]}")
    worst, worst_name = 0.0, ""
    for n, g in ref.items():
        denom = max(g.abs().max().item(), floor if floor is not None else torch.finfo(g.dtype).eps)
        err = (got[n] - g).abs().max().item() / denom
        if err > worst:
            worst, worst_name = err, n
    return worst, worst_name


def grad_rel_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """One global relative error: ``max_k max|a_k - b_k| / max_k max|a_k|`` over parameters (``a`` is the reference).

    Unlike :func:`max_rel_grad_error` (per-tensor scale), small gradients are measured against the largest one.

    Raises:
        ValueError: the parameter sets differ or are empty.
    """
    if a.keys() != b.keys() or not a:
        raise ValueError(f"a, b: expected the same non-empty set of parameter names, got {sorted(a)} vs {sorted(b)}. "
                         "Compare gradients of the same model.")
    scale = max(v.abs().max().item() for v in a.values())
    return max((a[k] - b[k]).abs().max().item() for k in a) / scale
