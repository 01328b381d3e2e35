"""Hybrid linear-attention models (Qwen3.5 dense/MoE, Qwen3-Next, OLMo-hybrid): zorro for their gated delta-net
layers.

These models interleave ``full_attention`` layers (they dispatch through the registered ``"zorro"`` attention) with
``linear_attention`` layers (``config.layer_types``), whose module mixes the sequence with a short causal conv and the
gated delta rule — not through the attention interface. :func:`wrap_linear_attention` replaces the ``forward`` of
each such module **instance** (never the class) with :func:`zorro_gated_deltanet_forward`, which runs the layer on the
packed row with each prompt processed once (:mod:`zorro_verl.recurrent`); :func:`unwrap_linear_attention` undoes it.

Kernels are the module's own: ``chunk_gated_delta_rule`` — transformers' torch fallback on CPU, flash-linear-attention
on GPU (then called varlen with ``cu_seqlens`` and one initial state per response, no padding; the fallback runs
padded) — and ``causal_conv1d_fn`` (causal-conv1d on GPU, else torch's conv1d) over a context-expanded row
(:func:`~zorro_verl.recurrent.packed_causal_conv`). On CUDA a missing fast kernel is warned about once per process and
counted per layer call in the step's ``LayerCalls.fallbacks[<library>]``.

OLMo-hybrid: separate ``q/k/v/a/b/g`` projections and a short conv module per ``q`` / ``k`` / ``v`` projection (fla's
``ShortConvolution`` on GPU); being depthwise, the three are one conv over ``[q | k | v]`` with their weights stacked
(:func:`deltanet_conv`), which zorro runs with torch's conv1d on every device (exact; fla's conv is not called).
``beta`` is doubled where ``allow_neg_eigval``; ``o_norm`` / ``o_proj`` stand for ``norm`` / ``out_proj``.
"""

from __future__ import annotations

import types
import warnings

import torch
import torch.nn.functional as F

from zorro_verl.attention.ulysses import heads_to_sequence, sequence_to_heads
from zorro_verl.integrations.transformers.context import LayerCalls, StepContext, require_context
from zorro_verl.recurrent import packed_causal_conv, packed_gated_delta_rule

__all__ = [
    "LINEAR_ATTENTION",
    "text_config",
    "linear_attention_modules",
    "check_linear_attention_supported",
    "wrap_linear_attention",
    "unwrap_linear_attention",
    "is_wrapped",
    "zorro_gated_deltanet_forward",
    "linear_attention_sp_repeat",
]

LINEAR_ATTENTION = "linear_attention"

#: Attributes every supported gated delta-net module has; plus one of the projection layouts below (Qwen3.5 and
#: Qwen3-Next: one conv over [q | k | v], ``norm``, ``out_proj``; OLMo-hybrid: a conv per projection, ``o_norm``,
#: ``o_proj``, optionally ``beta`` doubled by ``allow_neg_eigval``).
_COMMON_ATTRS = ("A_log", "dt_bias", "chunk_gated_delta_rule", "num_k_heads", "num_v_heads", "head_k_dim",
                 "head_v_dim", "key_dim", "value_dim", "conv_kernel_size")
_FUSED_CONV_ATTRS = ("conv1d", "norm", "out_proj")
_LAYOUT_QWEN3_5 = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
_LAYOUT_QWEN3_NEXT = ("in_proj_qkvz", "in_proj_ba", "fix_query_key_value_ordering")
_LAYOUT_OLMO_HYBRID = ("q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj", "o_proj", "o_norm", "q_conv1d",
                       "k_conv1d", "v_conv1d", "allow_neg_eigval")
_SUPPORTED = "Qwen3.5 (dense/MoE), Qwen3-Next and OLMo-hybrid"
#: Attributes of MiniMax's lightning attention (MiniMaxLightningAttention), run by :mod:`.mixers`.
_LIGHTNING_ATTRS = ("qkv_proj", "output_gate", "out_proj", "norm", "act_fn", "slope_rate", "block_size",
                    "num_attention_heads", "head_dim")
_SILU = ("silu", "swish")
_NO_FORWARD = object()  # marks "the instance had no forward of its own" for unwrap
_warned_fallback: set = set()


def text_config(model):
    cfg = model.config
    return getattr(cfg, "text_config", None) or cfg


def is_lightning_attention(mod) -> bool:
    """Whether ``mod`` is a lightning attention module (MiniMax's layout), run by :mod:`.mixers`, not here."""
    return isinstance(mod, torch.nn.Module) and all(hasattr(mod, a) for a in _LIGHTNING_ATTRS)


def linear_attention_modules(model) -> list[tuple[int, torch.nn.Module]]:
    """``[(layer_index, module)]`` of every gated delta-net ``linear_attention`` layer per ``config.layer_types``
    (empty if none). Lightning-attention layers (MiniMax, :mod:`.mixers`) are not listed.

    Raises ``ValueError`` when such a layer has neither a ``linear_attn`` module nor a lightning attention (an unknown
    hybrid layout).
    """
    types_ = getattr(text_config(model), "layer_types", None) or []
    if LINEAR_ATTENTION not in types_:
        return []
    layers = getattr(model.get_decoder(), "layers", None)
    if layers is None:
        raise ValueError("model: config.layer_types has linear_attention layers but the decoder has no `layers` "
                         "list; zorro cannot find them. This model is not supported by zorro.")
    out = []
    for i, t in enumerate(types_[: len(layers)]):
        if t != LINEAR_ATTENTION or is_lightning_attention(getattr(layers[i], "self_attn", None)):
            continue
        mod = getattr(layers[i], "linear_attn", None)
        if not isinstance(mod, torch.nn.Module):
            raise ValueError(f"model: layer {i} is a linear_attention layer without a `linear_attn` module; zorro "
                             f"supports the gated delta-net layers of {_SUPPORTED} and MiniMax's lightning "
                             "attention only.")
        out.append((i, mod))
    return out


def _layout(mod):
    """The projection layout of a gated delta-net module (one of the ``_LAYOUT_*`` tuples) or None."""
    for lay in (_LAYOUT_QWEN3_5, _LAYOUT_QWEN3_NEXT, _LAYOUT_OLMO_HYBRID):
        if all(hasattr(mod, a) for a in lay):
            return lay
    return None


def check_linear_attention_supported(model) -> list[tuple[int, torch.nn.Module]]:
    """Check every linear-attention module is a gated delta-net zorro can run; returns them. Raises ``ValueError``."""
    mods = linear_attention_modules(model)
    for i, mod in mods:
        layout = _layout(mod)
        common = _COMMON_ATTRS + (_FUSED_CONV_ATTRS if layout is not _LAYOUT_OLMO_HYBRID else ())
        missing = [a for a in common if not hasattr(mod, a)]
        if missing or layout is None:
            raise ValueError(
                f"model: linear-attention layer {i} ({type(mod).__name__}) is not a gated delta-net zorro knows "
                f"(missing {missing or 'a known projection layout'}); running it over the packed row would let a "
                f"response see its siblings — refused. Supported: {_SUPPORTED}.")
        act = getattr(mod, "activation", "silu")
        if layout is _LAYOUT_OLMO_HYBRID:
            act = next((type(c.act_fn).__name__ for c in _olmo_convs(mod)
                        if type(c.act_fn).__name__ not in ("SiLU", "SiLUActivation")), "silu")
        if act not in _SILU:
            raise ValueError(f"model: linear-attention layer {i} uses conv activation {act!r}; zorro supports "
                             f"{_SILU}.")
    return mods


def is_wrapped(module: torch.nn.Module) -> bool:
    return "_zorro_saved_forward" in module.__dict__


def wrap_linear_attention(model) -> int:
    """Replace ``forward`` of each linear-attention module instance (idempotent). Returns how many are wrapped.

    OLMo-hybrid's decoder layer calls its delta-net without kwargs (:func:`passes_no_kwargs`): its layer instance
    gets a context carrier from :func:`.mixers.wrap_mixers`, as Mamba-2 layers do (:mod:`.ssm`).
    """
    mods = check_linear_attention_supported(model)
    for _, mod in mods:
        if is_wrapped(mod):
            continue
        mod._zorro_saved_forward = mod.__dict__.get("forward", _NO_FORWARD)
        mod.forward = types.MethodType(zorro_gated_deltanet_forward, mod)
    return len(mods)


def unwrap_linear_attention(model) -> None:
    """Restore the forward each wrapped linear-attention module had before :func:`wrap_linear_attention`."""
    for _, mod in linear_attention_modules(model):
        if not is_wrapped(mod):
            continue
        saved = mod.__dict__.pop("_zorro_saved_forward")
        if saved is _NO_FORWARD:
            del mod.forward
        else:
            mod.forward = saved


def passes_no_kwargs(mod) -> bool:
    """Whether the family's decoder layer calls this delta-net without its kwargs (OLMo-hybrid), so the step context
    must be handed over by a carrier on the layer."""
    return _layout(mod) is _LAYOUT_OLMO_HYBRID


def _uses_fla(fn) -> bool:
    return (getattr(fn, "__module__", "") or "").split(".")[0] == "fla"


def _report_fallback(calls: LayerCalls, library: str, consequence: str, pip_name: str) -> None:
    """A fast GPU kernel is missing: warn once per process, count every layer call in the step's counter."""
    calls.fallbacks[library] = calls.fallbacks.get(library, 0) + 1
    if library not in _warned_fallback:
        _warned_fallback.add(library)
        warnings.warn(f"zorro: {library} is not installed; on GPU {consequence}. `pip install {pip_name}` for "
                      "speed.", RuntimeWarning, stacklevel=3)


def gated_deltanet_projections(mod, h: torch.Tensor):
    """Token-wise projections of the layer exactly as the model computes them.

    Args: h ``[1, T, hidden]``. Returns ``mixed_qkv [T, C]`` (conv input, channels ``[q | k | v]``), ``z [T, H,
    Dv]`` (the output gate), ``b``, ``a [T, H]``.
    """
    T = h.shape[1]
    if hasattr(mod, "in_proj_qkvz"):  # Qwen3-Next: interleaved per key-head group
        q, k, v, z, b, a = mod.fix_query_key_value_ordering(mod.in_proj_qkvz(h), mod.in_proj_ba(h))
        mixed = torch.cat([x.reshape(1, T, -1) for x in (q, k, v)], -1)
    elif hasattr(mod, "in_proj_qkv"):  # Qwen3.5
        mixed = mod.in_proj_qkv(h)
        z = mod.in_proj_z(h)
        b, a = mod.in_proj_b(h), mod.in_proj_a(h)
    else:  # OLMo-hybrid: separate projections (each with its own conv; depthwise, so one conv over [q | k | v])
        mixed = torch.cat([mod.q_proj(h), mod.k_proj(h), mod.v_proj(h)], -1)
        z = mod.g_proj(h)
        b, a = mod.b_proj(h), mod.a_proj(h)
    return mixed[0], z.reshape(T, -1, mod.head_v_dim), b.reshape(T, -1), a.reshape(T, -1)


def _olmo_convs(mod):
    return mod.q_conv1d, mod.k_conv1d, mod.v_conv1d


def deltanet_conv(mod):
    """The layer's depthwise conv over ``[q | k | v]``: ``(weight [C, Kc], bias [C] | None)``. OLMo-hybrid's three
    convs (one per projection) are one conv over the concatenated channels (a depthwise conv is per channel)."""
    if hasattr(mod, "conv1d"):
        return mod.conv1d.weight.squeeze(1), mod.conv1d.bias
    convs = _olmo_convs(mod)
    weight = torch.cat([c.weight.squeeze(1) for c in convs], 0)
    bias = None if all(c.bias is None for c in convs) else torch.cat(
        [c.bias if c.bias is not None else c.weight.new_zeros(c.weight.shape[0]) for c in convs])
    return weight, bias


def deltanet_beta(mod, b: torch.Tensor) -> torch.Tensor:
    """``beta = sigmoid(b)`` ``[.., H]``, doubled where the layer allows negative eigenvalues (OLMo-hybrid)."""
    beta = b.sigmoid()
    return beta * 2.0 if getattr(mod, "allow_neg_eigval", False) else beta


def deltanet_output(mod, core: torch.Tensor, z: torch.Tensor, n: int) -> torch.Tensor:
    """The gated norm and output projection: ``core [n * H, Dv]``, ``z [n, H, Dv]`` -> ``[1, n, hidden]``."""
    norm, out = (mod.norm, mod.out_proj) if hasattr(mod, "out_proj") else (mod.o_norm, mod.o_proj)
    core = norm(core, z.reshape(-1, mod.head_v_dim))
    return out(core.reshape(1, n, -1))


def log_decay(mod, a: torch.Tensor) -> torch.Tensor:
    """``g = -exp(A_log) * softplus(a + dt_bias)`` ``[T, Hv]``, computed as the model does in fp32 for fp32 / bf16 /
    fp16 (``.float()`` keeps ``exp(A_log)`` finite in fp16). In fp64 it stays fp64, where the model would round
    ``a`` and ``A_log`` (and, in backward, their gradients) to fp32: that fp32 rounding of gradients summed in a
    different order would cap fp64 agreement with the ordinary forward at ~1e-7.
    """
    dt = torch.float64 if a.dtype == torch.float64 else torch.float32
    return -mod.A_log.to(dt).exp() * F.softplus(a.to(dt) + mod.dt_bias)


def zorro_gated_deltanet_forward(self, hidden_states: torch.Tensor, cache_params=None, attention_mask=None,
                                 zorro_ctx: StepContext | None = None, **kwargs) -> torch.Tensor:
    """The wrapped forward of a gated delta-net module instance on the packed row.

    Under Ulysses sequence parallelism (``zorro_ctx.shard``) the token-wise projections run on the rank's slice, the
    conv inputs (per key / value head), ``g`` and ``beta`` are exchanged for head shards of the whole row (the
    attention layers' all-to-all), the packed conv and recurrence run there on the rank's heads (conv channels and
    weight rows of those heads), and the output comes back to the slice before the gated norm and ``out_proj``.

    Args:
        hidden_states: ``[1, T, hidden]`` (the packed dedup row; ``[1, L, hidden]``, this rank's slice, under SP).
        zorro_ctx: the step context (plan, backend, layer-call counter) — the ``zorro_ctx`` kwarg of the model call.

    Returns:
        ``[1, T, hidden]`` (``[1, L, hidden]`` under SP) equal, token for token, to the module's output on each
        ordinary row ``[prompt|response]``.
    """
    ctx = require_context(zorro_ctx or self.__dict__.get("_zorro_layer_ctx"), "zorro linear attention")
    if cache_params is not None:
        raise ValueError("zorro linear attention: got a cache; zorro runs training forwards. Call the model with "
                         "use_cache=False.")
    if attention_mask is not None:
        raise ValueError("zorro linear attention: got an attention_mask; call the model without one (the plan "
                         "carries the structure).")
    plan, shard = ctx.plan, ctx.shard
    n = plan.T if shard is None else shard.local_len
    if hidden_states.dim() != 3 or hidden_states.shape[0] != 1 or hidden_states.shape[1] != n:
        what = "one packed row" if shard is None else f"this rank's slice of {shard.sp_size}"
        raise ValueError(f"zorro linear attention: expected hidden_states [1, {n}, hidden] ({what}), got "
                         f"{tuple(hidden_states.shape)}.")
    ctx.calls.recurrent += 1
    mixed, z, b, a = gated_deltanet_projections(self, hidden_states)  # [n, C], [n, Hv, Dv], [n, Hv], [n, Hv]
    conv_fn = getattr(self, "causal_conv1d_fn", None)
    if hidden_states.is_cuda:
        if conv_fn is None and not passes_no_kwargs(self):  # OLMo-hybrid: torch's conv1d always (docstring)
            _report_fallback(ctx.calls, "causal-conv1d", "the packed conv runs torch's conv1d (exact, a little slower)",
                             "causal-conv1d")
        if not _uses_fla(self.chunk_gated_delta_rule):
            _report_fallback(ctx.calls, "flash-linear-attention", "the gated delta rule runs the torch fallback kernel "
                             "(exact but slow)", "flash-linear-attention")
    beta = deltanet_beta(self, b)  # token-wise per head: computed before any exchange
    g = log_decay(self, a)  # [n, Hv]
    weight, bias = deltanet_conv(self)  # [C, Kc], [C] | None
    hk_l, hv_l, dk, dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim  # this rank's heads
    if shard is not None:  # Ulysses: sequence shards -> head shards around the conv and the recurrence
        mixed, weight, bias, g, beta, hk_l = _exchange_to_heads(self, mixed, weight, bias, g, beta, shard)
        hv_l //= shard.sp_size
    T = plan.T
    x = packed_causal_conv(mixed, weight, bias, plan, activation="silu", causal_conv1d_fn=conv_fn)  # [T, C_local]
    q, k, v = torch.split(x, [hk_l * dk, hk_l * dk, hv_l * dv], dim=-1)
    q, k, v = q.reshape(T, hk_l, dk), k.reshape(T, hk_l, dk), v.reshape(T, hv_l, dv)  # [T, Hk_l, Dk], [T, Hv_l, Dv]
    rep = hv_l // hk_l
    if rep > 1:
        q = q.repeat_interleave(rep, dim=1)
        k = k.repeat_interleave(rep, dim=1)
    kernel = self.chunk_gated_delta_rule
    core = packed_gated_delta_rule(kernel, q, k, v, g, beta, plan, varlen=_uses_fla(kernel))  # [T, Hv_l, Dv]
    if shard is not None:
        core = heads_to_sequence(core, shard)  # [L, Hv, Dv]
    return deltanet_output(self, core.reshape(-1, dv), z, n)


def _exchange_to_heads(mod, mixed: torch.Tensor, weight: torch.Tensor, bias, g: torch.Tensor, beta: torch.Tensor,
                       shard):
    """The Ulysses exchange of a gated delta-net layer's sequence mixers' inputs (docs/design/verl.md).

    The conv is depthwise (per channel) and the delta rule runs per value head, so both run unchanged on any subset
    of heads. Channels are ``[q (Hk Dk) | k (Hk Dk) | v (Hv Dv)]``, the conv weight's rows in the same order.

    Args:
        mixed: ``[L, C]`` conv inputs of this rank's tokens; weight: ``[C, Kc]``; bias: ``[C]`` or None;
            g, beta: ``[L, Hv]`` (log decay, fp32 or fp64; write strength).

    Returns:
        ``(mixed [T, C_l], weight [C_l, Kc], bias [C_l] | None, g [T, Hv_l], beta [T, Hv_l], Hk_l)``: the whole
        deduplicated row for this rank's heads (``Hv_l = Hv / sp``; ``Hk_l = Hk / sp``, or ``Hv_l`` after the key
        heads' repeat when ``sp`` does not divide them), the conv channels and weight rows of those heads.
    """
    hk, hv, dk, dv, sp, r = mod.num_k_heads, mod.num_v_heads, mod.head_k_dim, mod.head_v_dim, shard.sp_size, shard.rank
    n = mixed.shape[0]
    rep_k = linear_attention_sp_repeat(hk, hv, sp)
    sizes = [mod.key_dim, mod.key_dim, mod.value_dim]
    q, k, v = torch.split(mixed, sizes, dim=-1)
    q, k, v = q.reshape(n, hk, dk), k.reshape(n, hk, dk), v.reshape(n, hv, dv)
    wq, wk, wv = torch.split(weight, sizes, dim=0)
    wq, wk, wv = wq.reshape(hk, dk, -1), wk.reshape(hk, dk, -1), wv.reshape(hv, dv, -1)
    parts = [wq, wk, wv]
    if bias is not None:
        bq, bk, bv = torch.split(bias, sizes)
        parts += [bq.reshape(hk, dk), bk.reshape(hk, dk), bv.reshape(hv, dv)]
    if rep_k > 1:  # fewer key heads than SP ranks: each key head (and its channels) once per value head, in order
        q, k = q.repeat_interleave(rep_k, 1), k.repeat_interleave(rep_k, 1)
        parts = [x.repeat_interleave(rep_k, 0) if i % 3 < 2 else x for i, x in enumerate(parts)]
    hk_l, hv_l = q.shape[1] // sp, hv // sp
    q, k, v, g, beta = (sequence_to_heads(x, shard) for x in (q, k, v, g, beta))  # [T, H/sp, ...]
    T = q.shape[0]
    own = [x[r * h:(r + 1) * h] for x, h in zip(parts, (hk_l, hk_l, hv_l) * 2)]  # this rank's heads' channels
    mixed = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], -1)  # [T, C_l]
    weight = torch.cat([x.reshape(-1, x.shape[-1]) for x in own[:3]], 0)  # [C_l, Kc]
    bias = torch.cat([x.reshape(-1) for x in own[3:]]) if bias is not None else None
    return mixed, weight, bias, g, beta, hk_l


def linear_attention_sp_repeat(num_k_heads: int, num_v_heads: int, sp_size: int) -> int:
    """How many times each key head is repeated before the Ulysses exchange of a gated delta-net layer: 1 when
    ``sp`` divides the key heads, else ``Hv / Hk`` (every value head takes its own copy of its key head) when ``sp``
    divides the value heads. Raises ``ValueError`` naming the fix when ``sp`` divides neither."""
    if num_v_heads % sp_size:
        raise ValueError(f"ulysses_sequence_parallel_size: {sp_size} must divide the gated delta-net's value heads "
                         f"(linear_num_value_heads = {num_v_heads}); choose a sequence-parallel size that divides it.")
    return 1 if num_k_heads % sp_size == 0 else num_v_heads // num_k_heads
