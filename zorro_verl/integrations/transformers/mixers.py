"""Other sequence mixers: LFM2's short gated convolutions and MiniMax's lightning attention.

* ``conv`` layers (``config.layer_types``) of LFM2 / LFM2-MoE: ``out_proj(C * conv(B * x))`` with ``[B | C | x] =
  in_proj(h)`` and a depthwise causal conv of kernel ``L_cache`` (no activation). On the packed row the conv runs over
  a context-expanded row (:func:`~zorro_verl.recurrent.packed_causal_conv`): each response sees its own prompt's last
  ``L_cache - 1`` conv inputs, a prompt sees zeros. LFM2's decoder layer calls its conv without kwargs, so a *carrier*
  on each decoder layer instance hands the step context to the conv for the duration of the layer's call (re-run by
  gradient checkpointing, so checkpointing works).
* OLMo-hybrid's decoder layer calls its gated delta-net (run by :mod:`.hybrid`) without kwargs: its layers get the
  same carrier here.
* ``linear_attention`` layers of MiniMax (MiniMax-Text-01 / M1) whose ``self_attn`` is a lightning attention: a
  decayed linear recurrence per head over a state ``[Dk, Dv]`` (:mod:`zorro_verl.recurrent.lightning`); each prompt
  runs once and every response starts from its prompt's final state. The decoder layer passes the context kwarg on.

:func:`wrap_mixers` replaces the ``forward`` of each such module **instance** (never the class);
:func:`unwrap_mixers` undoes it. Under Ulysses sequence parallelism each rank runs the short conv on ``1 / sp`` of the
channels and the lightning attention on ``1 / sp`` of the heads over the whole deduplicated row, exchanged around
them as the gated delta-net's are (``sp`` must divide them: refused by name otherwise).

Kernels: the short conv runs causal-conv1d's ``causal_conv1d_fn`` where the model's module loaded it (as the stock
CUDA path does), else torch's conv1d (counted as ``"causal-conv1d"`` on CUDA). Lightning attention runs zorro's torch
chunked scan in fp32 (fp64 kept) — transformers' own lightning attention is torch code too, in the model's dtype.
"""

from __future__ import annotations

import sys

import torch

from zorro_verl.attention.ulysses import heads_to_sequence, sequence_to_heads
from zorro_verl.integrations.transformers.context import StepContext, require_context
from zorro_verl.integrations.transformers.hybrid import (
    LINEAR_ATTENTION,
    _report_fallback,
    is_lightning_attention,
    linear_attention_modules,
    passes_no_kwargs,
    text_config,
)
from zorro_verl.integrations.transformers.ssm import (
    _layer_carrier_forward,
    _restore,
    _swap,
    is_wrapped,
    set_carried_mixer,
)
from zorro_verl.recurrent import packed_causal_conv, packed_lightning_attention

__all__ = ["SHORT_CONV", "short_conv_modules", "lightning_modules", "is_lightning_attention", "check_mixers_supported",
           "mixers_sp_unsupported", "wrap_mixers", "unwrap_mixers", "zorro_short_conv_forward",
           "zorro_lightning_forward"]

SHORT_CONV = "conv"

#: Attributes of LFM2's short gated conv (Lfm2ShortConv, Lfm2MoeShortConv).
_SHORT_CONV_ATTRS = ("in_proj", "conv", "out_proj", "L_cache")


def _layers(model, what: str):
    layers = getattr(model.get_decoder(), "layers", None)
    if layers is None:
        raise ValueError(f"model: config.layer_types has {what} layers but the decoder has no `layers` list; zorro "
                         "cannot find them. This model is not supported by zorro.")
    return layers


def short_conv_modules(model) -> list[tuple[int, torch.nn.Module, torch.nn.Module]]:
    """``[(layer_index, decoder layer, conv module)]`` of every ``conv`` layer per ``config.layer_types`` (empty if
    none). Raises ``ValueError`` when such a layer has no short-conv module zorro knows."""
    types_ = getattr(text_config(model), "layer_types", None) or []
    if SHORT_CONV not in types_:
        return []
    layers = _layers(model, "conv")
    out = []
    for i, t in enumerate(types_[: len(layers)]):
        if t != SHORT_CONV:
            continue
        mod = getattr(layers[i], "conv", None)
        if not isinstance(mod, torch.nn.Module) or not all(hasattr(mod, a) for a in _SHORT_CONV_ATTRS):
            raise ValueError(f"model: layer {i} is a conv layer whose `conv` module zorro does not know (expected "
                             f"LFM2's short gated conv with {list(_SHORT_CONV_ATTRS)}); running it over the packed "
                             "row would let a response see its siblings — refused.")
        out.append((i, layers[i], mod))
    return out


def lightning_modules(model) -> list[tuple[int, torch.nn.Module]]:
    """``[(layer_index, module)]`` of every ``linear_attention`` layer whose ``self_attn`` is a lightning attention
    (MiniMax; the gated delta-nets of the other families are :func:`.hybrid.linear_attention_modules`)."""
    types_ = getattr(text_config(model), "layer_types", None) or []
    if LINEAR_ATTENTION not in types_:
        return []
    layers = getattr(model.get_decoder(), "layers", None) or []
    return [(i, layers[i].self_attn) for i, t in enumerate(types_[: len(layers)])
            if t == LINEAR_ATTENTION and is_lightning_attention(getattr(layers[i], "self_attn", None))]


def check_mixers_supported(model) -> None:
    """Check every ``conv`` layer is LFM2's short conv (raises ``ValueError``); lightning layers are recognised by
    their layout (:func:`is_lightning_attention`), anything else is refused by :mod:`.hybrid`."""
    short_conv_modules(model)


def mixers_sp_unsupported(model, sp_size: int) -> str | None:
    """Why ``model`` cannot run under Ulysses SP of ``sp_size``, or None: each rank runs whole channels of a short
    conv (``sp`` must divide ``hidden_size``) and whole heads of a lightning attention (``sp`` must divide its
    heads)."""
    if sp_size <= 1:
        return None
    for i, _, mod in short_conv_modules(model):
        if mod.conv.weight.shape[0] % sp_size:
            return (f"ulysses_sequence_parallel_size: {sp_size} must divide the short conv's channels (hidden_size = "
                    f"{mod.conv.weight.shape[0]}, layer {i}); choose a sequence-parallel size that divides it.")
    for i, mod in lightning_modules(model):
        if mod.num_attention_heads % sp_size:
            return (f"ulysses_sequence_parallel_size: {sp_size} must divide the lightning attention's heads "
                    f"(num_attention_heads = {mod.num_attention_heads}, layer {i}); choose a sequence-parallel size "
                    "that divides it.")
    return None


def _carried_deltanets(model) -> list[tuple[torch.nn.Module, torch.nn.Module]]:
    """``[(decoder layer, delta-net)]`` of the gated delta-nets whose layer passes no kwargs (OLMo-hybrid)."""
    mods = [(i, m) for i, m in linear_attention_modules(model) if passes_no_kwargs(m)]
    layers = model.get_decoder().layers if mods else []
    return [(layers[i], m) for i, m in mods]


def wrap_mixers(model) -> int:
    """Replace ``forward`` of each short-conv module (plus its decoder layer's context carrier) and each lightning
    attention instance, and add the carriers of OLMo-hybrid's delta-net layers (wrapped by :mod:`.hybrid`)
    (idempotent). Returns how many mixers are wrapped here."""
    convs, light = short_conv_modules(model), lightning_modules(model)
    carried = [(layer, mod) for _, layer, mod in convs] + _carried_deltanets(model)
    for _, _, mod in convs:
        if not is_wrapped(mod):
            _swap(mod, zorro_short_conv_forward)
    for layer, mod in carried:
        if not is_wrapped(layer):
            set_carried_mixer(layer, mod)
            _swap(layer, _layer_carrier_forward)
    for _, mod in light:
        if not is_wrapped(mod):
            _swap(mod, zorro_lightning_forward)
    return len(convs) + len(light)


def unwrap_mixers(model) -> None:
    """Restore the forwards :func:`wrap_mixers` replaced."""
    for _, _, mod in short_conv_modules(model):
        if is_wrapped(mod):
            _restore(mod)
    for layer, _ in [(lay, m) for _, lay, m in short_conv_modules(model)] + _carried_deltanets(model):
        if is_wrapped(layer):
            _restore(layer)
        layer.__dict__.pop("_zorro_mixer", None)
    for _, mod in lightning_modules(model):
        if is_wrapped(mod):
            _restore(mod)


def _checked_context(self, zorro_ctx, hidden_states, what: str, cache, attention_mask):
    ctx = require_context(zorro_ctx or self.__dict__.get("_zorro_layer_ctx"), what)
    if cache is not None:
        raise ValueError(f"{what}: got a cache; zorro runs training forwards. Call the model with use_cache=False.")
    if attention_mask is not None:
        raise ValueError(f"{what}: got an attention_mask; call the model without one (the plan carries the "
                         "structure).")
    shard = ctx.shard
    n = ctx.plan.T if shard is None else shard.local_len
    if hidden_states.dim() != 3 or hidden_states.shape[0] != 1 or hidden_states.shape[1] != n:
        what_row = "one packed row" if shard is None else f"this rank's slice of {shard.sp_size}"
        raise ValueError(f"{what}: expected hidden_states [1, {n}, hidden] ({what_row}), got "
                         f"{tuple(hidden_states.shape)}.")
    ctx.calls.recurrent += 1
    return ctx


def zorro_short_conv_forward(self, hidden_states: torch.Tensor, past_key_values=None, attention_mask=None,
                             zorro_ctx: StepContext | None = None, **kwargs) -> torch.Tensor:
    """The wrapped forward of an LFM2 short-conv instance on the packed row.

    Under Ulysses SP (``zorro_ctx.shard``) the conv inputs ``B * x`` of the rank's slice are exchanged for a
    ``1 / sp`` share of the channels over the whole row (the conv is depthwise: it runs unchanged on any channels,
    with those channels' weight rows), and the output comes back to the slice before the gate and ``out_proj``.

    Args:
        hidden_states: ``[1, T, hidden]`` (the packed dedup row; ``[1, L, hidden]``, this rank's slice, under SP);
            the context comes from the layer carrier.

    Returns:
        ``[1, T, hidden]`` (``[1, L, hidden]`` under SP) equal, token for token, to the module's output on each
        ordinary row: ``out_proj(C * conv(B * x))``, the conv of each response continuing from its prompt's last
        ``L_cache - 1`` inputs.
    """
    ctx = _checked_context(self, zorro_ctx, hidden_states, "zorro short conv", past_key_values, attention_mask)
    shard, n = ctx.shard, hidden_states.shape[1]
    B, C, x = self.in_proj(hidden_states)[0].chunk(3, dim=-1)  # [n, hidden] each, as the model splits them
    conv_fn = getattr(sys.modules.get(type(self).__module__), "causal_conv1d_fn", None)
    if hidden_states.is_cuda and conv_fn is None:
        _report_fallback(ctx.calls, "causal-conv1d", "the packed conv runs torch's conv1d (exact, a little slower)",
                         "causal-conv1d")
    bx, weight, bias = B * x, self.conv.weight.squeeze(1), self.conv.bias  # [n, hidden], [hidden, Kc], [hidden]
    if shard is not None:  # channel shares as "heads": [n, sp, hidden / sp] -> [T, 1, hidden / sp]
        sp, c = shard.sp_size, bx.shape[-1] // shard.sp_size
        if bx.shape[-1] % sp:
            raise ValueError(f"ulysses_sequence_parallel_size: {sp} must divide the short conv's channels "
                             f"(hidden_size = {bx.shape[-1]}); choose a sequence-parallel size that divides it.")
        own = slice(shard.rank * c, (shard.rank + 1) * c)
        bx = sequence_to_heads(bx.reshape(n, sp, c), shard).reshape(-1, c)
        weight, bias = weight[own], (bias[own] if bias is not None else None)
    y = packed_causal_conv(bx, weight, bias, ctx.plan, causal_conv1d_fn=conv_fn)  # [T, hidden or hidden / sp]
    if shard is not None:
        y = heads_to_sequence(y[:, None], shard).reshape(n, -1)  # [n, hidden]
    return self.out_proj((C * y)[None])


def zorro_lightning_forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                            past_key_values=None, zorro_ctx: StepContext | None = None, **kwargs):
    """The wrapped forward of a MiniMax lightning attention instance on the packed row.

    Under Ulysses SP (``zorro_ctx.shard``) ``q``, ``k``, ``v`` of the rank's slice are exchanged for ``1 / sp`` of
    the heads over the whole row (heads are independent; each keeps its own slope), and the output comes back to the
    slice before the norm, the gate and ``out_proj``.

    Args:
        hidden_states: ``[1, T, hidden]`` (the packed dedup row; ``[1, L, hidden]``, this rank's slice, under SP);
            zorro_ctx: the step context (the decoder layer passes it on).

    Returns:
        ``(out [1, T, hidden], None)`` (``[1, L, hidden]`` under SP): ``out_proj(sigmoid(output_gate(h)) *
        norm(o))`` with ``o`` the lightning attention of each ordinary row
        (:func:`~zorro_verl.recurrent.packed_lightning_attention`, computed in fp32, fp64 kept, and cast to the
        model's dtype as the stock output is); no state is returned (no cache).
    """
    ctx = _checked_context(self, zorro_ctx, hidden_states, "zorro lightning attention", past_key_values,
                           attention_mask)
    shard, n, H, D = ctx.shard, hidden_states.shape[1], self.num_attention_heads, self.head_dim
    qkv = self.act_fn(self.qkv_proj(hidden_states)).reshape(n, H, 3 * D)
    q, k, v = torch.split(qkv, D, dim=-1)  # [n, H, D] each
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    slope = self.slope_rate.to(cdt).reshape(H)
    if shard is not None:  # this rank's heads over the whole row: [T, H / sp, D]
        h = H // shard.sp_size
        if H % shard.sp_size:
            raise ValueError(f"ulysses_sequence_parallel_size: {shard.sp_size} must divide the lightning attention's "
                             f"heads (num_attention_heads = {H}); choose a sequence-parallel size that divides it.")
        q, k, v = (sequence_to_heads(t, shard) for t in (q, k, v))
        slope = slope[shard.rank * h:(shard.rank + 1) * h]
    o = packed_lightning_attention(q.to(cdt), k.to(cdt), v.to(cdt), slope, ctx.plan,
                                   chunk_size=self.block_size)  # [T, H or H / sp, D]
    if shard is not None:
        o = heads_to_sequence(o, shard)  # [n, H, D]
    o = self.norm(o.to(hidden_states.dtype).reshape(1, n, H * D))
    o = torch.sigmoid(self.output_gate(hidden_states)) * o
    return self.out_proj(o), None
