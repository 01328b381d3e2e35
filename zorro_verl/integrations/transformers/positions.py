"""Per-token position-dependent scales that a model computes from the sequence instead of ``position_ids``
(docs/design/model-step.md, "Position reads").

Llama 4's attention (``Llama4TextAttention``) scales the query of its NoPE layers (``use_rope`` False) with
``attn_temperature_tuning``: ``q *= 1 + attn_scale * log1p(floor((pos + 1) / floor_scale))``, but takes ``pos``
from ``arange(hidden_states.shape[1])`` — the index in the row it is given. On zorro's packed row that is the packed
index, not the token's position in its own row: every token past ``floor_scale`` packed tokens would get the scale
of a later position (real models: ``floor_scale = 8192``, so any packed row over 8192 tokens trains wrong, silently).

The fix is per module instance and reversible: :func:`fix_query_temperature` switches the module's own
computation off (``attn_temperature_tuning = False`` on the instance) and records ``(floor_scale, attn_scale)``;
zorro's attention function then applies the same scale from the plan's positions (:func:`apply_query_temperature`),
in the same dtype steps as transformers (the scale in fp32, the product in the query's dtype promotion, cast back),
so a token gets exactly the scale its ordinary row gives it. :func:`restore_query_temperature` undoes it.
The instances are found by their attributes (``attn_temperature_tuning``, ``floor_scale``, ``attn_scale``,
``use_rope``), not by class name.
"""

from __future__ import annotations

import torch

__all__ = ["fix_query_temperature", "restore_query_temperature", "apply_query_temperature", "temperature_layers"]

_ATTR = "_zorro_query_temperature"


def temperature_layers(model) -> list:
    """``[(name, module)]`` of the attention modules whose query temperature reads the sequence length (Llama 4's
    NoPE layers with ``attn_temperature_tuning``), fixed or not yet fixed."""
    out = []
    for name, mod in model.named_modules():
        if all(hasattr(mod, a) for a in ("attn_temperature_tuning", "floor_scale", "attn_scale", "use_rope")) \
                and not mod.use_rope and (mod.attn_temperature_tuning or hasattr(mod, _ATTR)):
            out.append((name, mod))
    return out


def fix_query_temperature(model) -> int:
    """Move the query temperature of every :func:`temperature_layers` module into zorro's attention (idempotent).
    Returns the number of layers fixed."""
    layers = temperature_layers(model)
    for _, mod in layers:
        if not hasattr(mod, _ATTR):
            setattr(mod, _ATTR, (mod.floor_scale, float(mod.attn_scale)))
            mod.attn_temperature_tuning = False  # instance attribute: the module's own arange-based scale is off
    return len(layers)


def restore_query_temperature(model) -> None:
    """Undo :func:`fix_query_temperature`: the modules compute their own scale again."""
    for mod in model.modules():
        if hasattr(mod, _ATTR):
            delattr(mod, _ATTR)
            mod.attn_temperature_tuning = True


def apply_query_temperature(module, query: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``query [1, Hq, L, D]`` scaled per token by the module's recorded temperature at ``positions [L]`` int64 (each
    token's position in its own row); unchanged for a module without one. transformers' arithmetic: the scale
    from ``positions.float()`` in fp32, ``(query * scale).to(query.dtype)``."""
    t = getattr(module, _ATTR, None)
    if t is None:
        return query
    floor_scale, attn_scale = t
    pos = positions.to(query.device)
    scales = torch.log1p(torch.floor((pos.float() + 1.0) / floor_scale)) * attn_scale + 1.0  # [L] fp32
    return (query * scales.view(1, 1, -1, 1)).to(query.dtype)
