"""State-space layers: zorro for the ``mamba`` layers of Mamba2, Bamba, Granite 4 hybrid (granitemoehybrid),
Nemotron-H and Zamba2 (Mamba-2 mixers) and of Mamba, FalconMamba and Jamba (Mamba v1 mixers), and for the ``hybrid``
layers of Zamba2 (a shared attention block feeding a Mamba-2 layer), Zamba (the same with a multi-head Mamba v1 mixer:
:func:`zorro_zamba_forward`) and Falcon-H1 (attention beside a Mamba-2 mixer with muP multipliers): their attention
runs through zorro's attention function, their mixer as below.

A ``mamba`` layer (``config.layer_types``) mixes the sequence with a depthwise causal conv and a selective scan
(:mod:`zorro_verl.recurrent.ssd`: Mamba-2's per-head scalar decay, or Mamba v1's per-element one), not through the
attention interface. :func:`wrap_mamba` replaces the ``forward`` of each mixer **instance** with
:func:`zorro_mamba2_forward` / :func:`zorro_mamba1_forward`, which run the layer on the packed row with each prompt
processed once (the conv over a context-expanded row, the scan from each prompt's final state); :func:`unwrap_mamba`
undoes it.

The step context reaches the mixer as the ``zorro_ctx`` kwarg where the family's decoder layer passes its kwargs on
(Bamba, Granite 4); where it does not, a *carrier* hands it over: each decoder layer instance (Nemotron-H, Jamba: the
layer gets the kwarg, its mixer does not) and the root model (Mamba2, Mamba, FalconMamba: neither the backbone nor its
blocks get kwargs) set it on the mixer for the duration of their call. A layer re-run by gradient checkpointing
re-runs its carrier, so checkpointing works where the layer gets the kwarg; where only the root carries it,
checkpointing is refused.

Kernels follow the path the stock mixer takes. Where it runs its fused CUDA path (mamba-ssm and causal-conv1d
installed, :func:`stock_runs_fused`), the Mamba-2 scan runs mamba-ssm's ``mamba_chunk_scan_combined`` as the model's
module loaded it (:func:`~zorro_verl.recurrent.fused_ssd_kernel`: prompts as one batch, then every response from its
prompt's final state through the kernel's ``initial_states``, whose gradient its backward returns), with ``x`` / ``B``
/ ``C`` in the model's dtype and the step size in fp32, as the fused kernel computes it. Elsewhere it runs
:func:`~zorro_verl.recurrent.chunk_ssd` (torch; fp64 kept in fp64, else fp32 as the models' torch path computes); on
CUDA without mamba-ssm that is warned once per process and counted per layer call in
``LayerCalls.fallbacks["mamba-ssm"]``, as flash-linear-attention is for the delta-net. The Mamba v1 scan runs
:func:`~zorro_verl.recurrent.selective_scan` (step by step, as transformers' torch path) on every device: mamba-ssm's
``selective_scan_fn`` takes no initial state, so a response cannot start from its prompt's state in it (on CUDA warned
and counted as ``"mamba-ssm"``). The Mamba-2 conv runs causal-conv1d's ``causal_conv1d_fn`` when the model's module has
it (the same contract as the gated delta-net's), else torch's conv1d (counted as ``"causal-conv1d"`` on CUDA).
"""

from __future__ import annotations

import functools
import sys
import types
import warnings

import torch
import torch.nn.functional as F

from zorro_verl.attention.ulysses import heads_to_sequence, sequence_to_heads
from zorro_verl.integrations.transformers.context import LayerCalls, StepContext, require_context
from zorro_verl.integrations.transformers.hybrid import _report_fallback, text_config
from zorro_verl.recurrent import chunk_ssd, fused_ssd_kernel, packed_causal_conv, packed_selective_scan, packed_ssd

__all__ = ["MAMBA", "HYBRID", "check_hybrid_supported", "mamba2_gated_output", "mamba_modules", "mamba_sp_unsupported",
           "check_mamba_supported", "is_mamba1", "wrap_mamba",
           "unwrap_mamba", "is_wrapped", "mamba2_projections", "ssm_decay_rate", "ssm_step_size", "stock_runs_fused",
           "fused_path_unsupported", "zorro_mamba2_forward", "mamba1_selection", "zorro_mamba1_forward",
           "is_multihead_mamba1", "zorro_zamba_forward",
           "set_carried_mixer"]

MAMBA = "mamba"
#: ``hybrid`` layers: Zamba2's shared attention block (attention through the registered function, token-wise LoRA
#: adapters) feeds a Mamba-2 layer (``mamba_decoder``); Falcon-H1's runs attention and a Mamba-2 mixer (muP
#: multipliers) side by side; Zamba's as Zamba2's with a multi-head Mamba v1 mixer; zorro runs both parts of each.
HYBRID = "hybrid"

#: Attributes of every Mamba-2 mixer zorro runs (Mamba2Mixer, BambaMixer, GraniteMoeHybridMambaLayer,
#: NemotronHMamba2Mixer): in_proj -> [.. | gate | x B C | dt], conv over x B C, the scan's A_log / dt_bias / D, a
#: gated norm and out_proj.
_MIXER_ATTRS = ("in_proj", "conv1d", "A_log", "D", "dt_bias", "norm", "out_proj", "act", "activation", "num_heads",
                "head_dim", "ssm_state_size", "n_groups", "intermediate_size", "conv_dim", "time_step_limit",
                "chunk_size", "torch_forward")
#: Attributes of a Mamba (v1) mixer (MambaMixer, FalconMambaMixer, JambaMambaMixer): in_proj -> [x | gate], conv
#: over x, x_proj -> [dt_rank | B | C], dt_proj, a selective scan over a per-channel state [intermediate, N].
_MAMBA1_ATTRS = ("in_proj", "conv1d", "x_proj", "dt_proj", "A_log", "D", "out_proj", "act", "intermediate_size",
                 "ssm_state_size", "time_step_rank")
#: Attributes of Zamba's multi-head Mamba (v1) mixer (ZambaMambaMixer): in_proj -> [x | gate] interleaved per
#: channel, conv over x, then per head of ``n_mamba_heads``: x_proj_weight -> [dt_rank | B | C], dt_proj_weight /
#: dt_proj_bias, a selective scan over the head's channels with its own B / C.
_ZAMBA_ATTRS = ("in_proj", "conv1d", "x_proj_weight", "dt_proj_weight", "dt_proj_bias", "A_log", "D", "out_proj",
                "act", "n_mamba_heads", "mamba_head_dim", "time_step_rank", "ssm_state_size", "intermediate_size")
_NO_FORWARD = object()
_warned: set = set()


def _layers(model):
    dec = model.get_decoder()
    layers = getattr(dec, "layers", None)
    if layers is None:
        raise ValueError("model: config.layer_types has mamba layers but the decoder has no `layers` list; zorro "
                         "cannot find them. This model is not supported by zorro.")
    return dec, layers


def _mixer_of(layer):
    for name in ("mamba", "mixer"):
        mod = getattr(layer, name, None)
        if isinstance(mod, torch.nn.Module):
            return mod
    dec = getattr(layer, "mamba_decoder", None)  # Zamba2's hybrid layer: shared attention block, then a Mamba layer
    return _mixer_of(dec) if isinstance(dec, torch.nn.Module) else None


def check_hybrid_supported(model) -> int:
    """Check every ``hybrid`` layer (``config.layer_types``) is one zorro runs exactly: Zamba2's (a shared attention
    block whose output feeds a Mamba-2 layer) or Falcon-H1's (attention and a muP-scaled Mamba-2 mixer side by side on
    the same input) or Zamba's (as Zamba2's, with a multi-head Mamba v1 mixer). Returns how many there are; raises
    ``ValueError`` for any other."""
    types_ = getattr(text_config(model), "layer_types", None) or []
    if HYBRID not in types_:
        return 0
    _, layers = _layers(model)
    n = 0
    for i, t in enumerate(types_[: len(layers)]):
        if t != HYBRID:
            continue
        layer, mixer = layers[i], _mixer_of(layers[i])
        attn = next((getattr(layer, a) for a in ("shared_transformer", "shared_transf", "self_attn")
                     if isinstance(getattr(layer, a, None), torch.nn.Module)), None)  # Zamba2, Zamba, Falcon-H1
        known = mixer is not None and (is_multihead_mamba1(mixer) or not is_mamba1(mixer)
                                       and all(hasattr(mixer, a) for a in _mixer_attrs(mixer)))
        if not known or not isinstance(attn, torch.nn.Module):
            raise ValueError(
                f"model: hybrid layer {i} ({type(layer).__name__}) is not a hybrid layer zorro knows (a shared "
                "attention block feeding a Mamba layer, as Zamba's and Zamba2's, or attention beside a Mamba-2 "
                "mixer, as Falcon-H1's); running it over the packed row would let a response see its siblings — "
                "refused.")
        n += 1
    return n


def mamba_modules(model) -> list[tuple[int, torch.nn.Module, torch.nn.Module]]:
    """``[(layer_index, decoder layer, mixer)]`` of every ``mamba`` layer per ``config.layer_types`` (empty if
    none). Raises ``ValueError`` when such a layer has no ``mamba`` / ``mixer`` module."""
    types_ = getattr(text_config(model), "layer_types", None) or []
    if MAMBA not in types_ and HYBRID not in types_:
        return []
    _, layers = _layers(model)
    out = []
    for i, t in enumerate(types_[: len(layers)]):
        if t not in (MAMBA, HYBRID):
            continue
        mod = _mixer_of(layers[i])
        if mod is None:
            raise ValueError(f"model: layer {i} is a mamba layer without a `mamba` / `mixer` module; zorro cannot "
                             "find its state-space mixer. This model is not supported by zorro.")
        out.append((i, layers[i], mod))
    return out


def _mixer_attrs(mod) -> tuple:
    """:data:`_MIXER_ATTRS` the mixer must have: Falcon-H1's without ``mamba_rms_norm`` has no norm (its output is
    ``y * silu(gate)``); one with a muP vector needs its input multiplier."""
    attrs = _MIXER_ATTRS
    if getattr(mod, "mamba_rms_norm", True) is False:
        attrs = tuple(a for a in attrs if a != "norm")
    return (*attrs, "ssm_in_multiplier") if hasattr(mod, "mup_vector") else attrs


def check_mamba_supported(model) -> list[tuple[int, torch.nn.Module, torch.nn.Module]]:
    """Check every ``mamba`` layer's mixer is a Mamba-2 or Mamba v1 mixer zorro can run; returns
    :func:`mamba_modules`. Raises ``ValueError`` naming the mixer class."""
    check_hybrid_supported(model)
    mods = mamba_modules(model)
    for i, _, mod in mods:
        name = type(mod).__name__
        if is_mamba1(mod) or is_multihead_mamba1(mod):
            continue
        missing = [a for a in _mixer_attrs(mod) if not hasattr(mod, a)]
        if missing:
            raise ValueError(
                f"model: mamba layer {i} ({name}) is not a Mamba-2 mixer zorro knows (missing {missing}); running it "
                "over the packed row would let a response see its siblings — refused. zorro runs the Mamba-2 mixers "
                "of Mamba2, Bamba, Granite 4 hybrid, Nemotron-H, Zamba2, Falcon-H1 and the Mamba (v1) mixers of "
                "Mamba, FalconMamba, Jamba, Zamba.")
    return mods


_SP_REFUSAL = ("Mamba (v1) layers under Ulysses sequence parallelism are not supported by zorro (their scan's B / C "
               "are shared by all channels and not exchanged across ranks); use ulysses_sequence_parallel_size = 1 "
               "for Mamba, FalconMamba, Jamba and Zamba models.")


def mamba_sp_unsupported(model, sp_size: int) -> str | None:
    """Why ``model`` cannot run under Ulysses SP of ``sp_size``, or None: Mamba v1 layers, or Mamba-2 heads that
    ``sp_size`` does not divide (each rank runs whole heads of the scan)."""
    if sp_size <= 1:
        return None
    for _, _, mod in mamba_modules(model):
        if is_mamba1(mod) or is_multihead_mamba1(mod):
            return f"ulysses_sequence_parallel_size = {sp_size}: {_SP_REFUSAL}"
        reason = _sp_heads_unsupported(mod, sp_size)
        if reason is not None:
            return reason
    return None


def _sp_heads_unsupported(mod, sp: int) -> str | None:
    if mod.num_heads % sp:
        return (f"ulysses_sequence_parallel_size: {sp} must divide the Mamba-2 heads (num_heads = {mod.num_heads}); "
                "each rank runs whole heads of the scan. Choose a sequence-parallel size that divides them.")
    return None


def is_multihead_mamba1(mod) -> bool:
    """Zamba's multi-head Mamba (v1) mixer: the :data:`_ZAMBA_ATTRS` and ``A_log [heads, head_dim, N]``."""
    return all(hasattr(mod, a) for a in _ZAMBA_ATTRS) and getattr(mod.A_log, "dim", lambda: 0)() == 3


def is_mamba1(mod) -> bool:
    """A Mamba (v1) mixer: the v1 attributes and a per-channel ``A_log [intermediate, N]``."""
    return all(hasattr(mod, a) for a in _MAMBA1_ATTRS) and getattr(mod.A_log, "dim", lambda: 0)() == 2


def is_wrapped(module: torch.nn.Module) -> bool:
    return "_zorro_saved_forward" in module.__dict__


def _swap(mod, fwd) -> None:
    mod._zorro_saved_forward = mod.__dict__.get("forward", _NO_FORWARD)
    mod.forward = types.MethodType(fwd, mod)


def _restore(mod) -> None:
    saved = mod.__dict__.pop("_zorro_saved_forward")
    if saved is _NO_FORWARD:
        del mod.forward
    else:
        mod.forward = saved


def _call_saved(mod, *args, **kwargs):
    saved = mod.__dict__["_zorro_saved_forward"]
    if saved is _NO_FORWARD:
        return type(mod).forward(mod, *args, **kwargs)
    return saved(*args, **kwargs)


def wrap_mamba(model) -> int:
    """Replace ``forward`` of each Mamba mixer instance, and add the context carriers on its decoder layer and the
    root (idempotent). Returns how many mixers are wrapped."""
    mods = check_mamba_supported(model)
    if not mods:
        return 0
    for _, layer, mixer in mods:
        if not is_wrapped(mixer):
            _swap(mixer, zorro_mamba1_forward if is_mamba1(mixer) else
                  zorro_zamba_forward if is_multihead_mamba1(mixer) else zorro_mamba2_forward)
        if not is_wrapped(layer):
            set_carried_mixer(layer, mixer)
            _swap(layer, _layer_carrier_forward)
    if not is_wrapped(model):
        model._zorro_mixers = [m for _, _, m in mods]
        _swap(model, _root_carrier_forward)
    return len(mods)


def unwrap_mamba(model) -> None:
    """Restore the forwards :func:`wrap_mamba` replaced."""
    for _, layer, mixer in mamba_modules(model):
        for mod in (mixer, layer):
            if is_wrapped(mod):
                _restore(mod)
        layer.__dict__.pop("_zorro_mixer", None)
    if is_wrapped(model) and "_zorro_mixers" in model.__dict__:
        _restore(model)
        del model._zorro_mixers


def set_carried_mixer(layer: torch.nn.Module, mixer: torch.nn.Module) -> None:
    """Point a decoder layer's carrier at its mixer, as a plain instance attribute: assigning a module to a module
    attribute would register it as a submodule a second time (duplicate ``state_dict`` keys, a second path for FSDP
    and ``named_modules``)."""
    layer.__dict__["_zorro_mixer"] = mixer


def _layer_carrier_forward(self, *args, **kwargs):
    """A decoder layer's forward: hands its ``zorro_ctx`` kwarg to its mixer for this call (the family's layer may
    not pass it on). A layer re-run by gradient checkpointing gets the kwarg again."""
    mixer = self._zorro_mixer
    ctx = kwargs.get("zorro_ctx")
    if ctx is None and mixer.__dict__.get("_zorro_root_ctx") is not None and self.training and \
            getattr(self, "gradient_checkpointing", False):
        raise ValueError(f"model: gradient checkpointing on {type(self).__name__} layers, whose model does not pass "
                         "zorro's step context to its layers (only the root gets it): a recomputed layer could not "
                         "find its plan. Disable gradient checkpointing for this model with zorro "
                         "(model.gradient_checkpointing_disable()).")
    mixer._zorro_layer_ctx = ctx
    try:
        return _call_saved(self, *args, **kwargs)
    finally:
        mixer._zorro_layer_ctx = None


def _root_carrier_forward(self, *args, **kwargs):
    """The root model's forward: hands its ``zorro_ctx`` kwarg to every Mamba-2 mixer for this call (Mamba2's backbone
    passes no kwargs to its blocks)."""
    ctx = kwargs.get("zorro_ctx")
    for m in self._zorro_mixers:
        m._zorro_root_ctx = ctx
    try:
        return _call_saved(self, *args, **kwargs)
    finally:
        for m in self._zorro_mixers:
            m._zorro_root_ctx = None


def mamba2_projections(mod, h: torch.Tensor):
    """The token-wise input projection of a Mamba-2 mixer exactly as the model computes it.

    Args: h ``[1, T, hidden]`` (or ``[b, L, hidden]``). Returns ``gate [.., I]``, ``xBC [.., conv_dim]`` (the conv
    input), ``dt [.., H]`` (before ``dt_bias`` / softplus), in the model's dtype. Falcon-H1's mixer scales its input
    by ``ssm_in_multiplier`` and the projection by its muP vector ``mup_vector [1, 1, proj]`` first, as it does.
    Mamba2 / Nemotron-H project two unused ``d_mlp`` blocks first (zero wide in their configs); they are skipped as
    the model skips them.
    """
    if hasattr(mod, "mup_vector"):  # Falcon-H1: muP multipliers on the input and on each projected block
        proj = mod.in_proj(h * mod.ssm_in_multiplier) * mod.mup_vector
    else:
        proj = mod.in_proj(h)
    tail = mod.intermediate_size + mod.conv_dim + mod.num_heads
    gate, xBC, dt = proj[..., proj.shape[-1] - tail:].split([mod.intermediate_size, mod.conv_dim, mod.num_heads], -1)
    return gate, xBC, dt


def mamba2_gated_output(mod, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The gated output of a Mamba-2 mixer before ``out_proj``, token-wise as the model computes it: its gated norm
    module, or (Falcon-H1 with ``mamba_rms_norm`` False) ``y * silu(gate)``. y, gate: ``[.., I]``."""
    if getattr(mod, "mamba_rms_norm", True) is False:
        return y * F.silu(gate)
    return mod.norm(y, gate)


def ssm_decay_rate(mod, compute_dtype: torch.dtype) -> torch.Tensor:
    """``A = -exp(A_log)`` ``[H]``: fp32 as the models compute it (``A_log.float()``), fp64 kept in fp64."""
    return -mod.A_log.to(compute_dtype).exp()


#: Mixers whose transformers torch path is not the Mamba-2 recurrence across its ``chunk_size``-token chunks (its
#: output depends on where the chunk boundaries fall; within one chunk it is exact): no deduplicated forward can equal
#: it on rows longer than one chunk. Their fused CUDA path (mamba-ssm) computes the recurrence.
_CHUNK_DEPENDENT_TORCH_PATH = ("NemotronHMamba2Mixer", "Zamba2MambaMixer")
#: Mixers whose torch path clamps the step size from below at ``time_step_min`` (their fused path, and every other
#: family, clamps it to ``time_step_limit``): zorro follows the path the stock model runs.
_CLAMP_AT_TIME_STEP_MIN = ("NemotronHMamba2Mixer", "Zamba2MambaMixer")


def stock_runs_fused(mod, h: torch.Tensor) -> bool:
    """Whether the stock mixer would run its fused CUDA path on ``h`` (mamba-ssm and causal-conv1d installed, CUDA)."""
    return h.is_cuda and bool(getattr(sys.modules.get(type(mod).__module__), "is_fast_path_available", False))


def fused_path_unsupported(mod) -> str | None:
    """Why zorro cannot equal the stock mixer's fused CUDA path (mamba-ssm's ``mamba_split_conv1d_scan_combined``), or
    None. Its gated RMS norm normalises each of the ``n_groups`` groups of ``intermediate / n_groups`` channels; the
    torch path's norm module of Mamba2 / Bamba / Granite normalises all channels at once, and zorro calls that module.
    The two agree for ``n_groups = 1`` (and for Nemotron-H, whose norm module is grouped)."""
    norm = getattr(mod, "norm", None)  # Falcon-H1 without mamba_rms_norm: none; with it, n_groups groups
    if norm is None or getattr(norm, "n_groups", None) == mod.n_groups:
        return None
    if mod.n_groups > 1 and getattr(norm, "group_size", None) != mod.intermediate_size // mod.n_groups:
        return (f"model: {type(mod).__name__} with n_groups = {mod.n_groups} on CUDA with mamba-ssm: the stock fused "
                "path normalises the scan output per group, its torch path (whose norm zorro runs) over all channels "
                "at once, so zorro cannot equal the stock forward. Uninstall mamba-ssm (the stock model then runs its "
                "torch path, which zorro equals) or use a model with n_groups = 1.")
    return None


def ssm_step_size(mod, dt: torch.Tensor, fused: bool = False) -> torch.Tensor:
    """``clamp(softplus(dt + dt_bias))`` ``[.., H]`` as the stock mixer computes it: in the model's dtype on its torch
    path; on its fused path (``fused``) in fp32 (fp64 kept), as mamba-ssm's kernel adds the bias and applies the
    softplus after loading ``dt``. Clamped to ``time_step_limit``, or (Nemotron-H's torch path, ``fused`` False) from
    below at ``time_step_min``."""
    if fused:
        cdt = torch.float64 if dt.dtype == torch.float64 else torch.float32
        dt = F.softplus(dt.to(cdt) + mod.dt_bias.to(cdt))
    else:
        dt = F.softplus(dt + mod.dt_bias)
    if not fused and type(mod).__name__ in _CLAMP_AT_TIME_STEP_MIN:
        return torch.clamp(dt, mod.time_step_min)
    if mod.time_step_limit is None:  # Zamba2's default: its fused path passes no dt_limit (no clamp)
        return dt
    lo, hi = mod.time_step_limit
    return torch.clamp(dt, lo, hi)


def _conv_fn(mod):
    """causal-conv1d's ``causal_conv1d_fn`` as the model's module loaded it (None when not installed)."""
    return getattr(sys.modules.get(type(mod).__module__), "causal_conv1d_fn", None)


def _scan_fn(mod):
    """mamba-ssm's ``mamba_chunk_scan_combined`` as the model's module loaded it (None when not installed)."""
    return getattr(sys.modules.get(type(mod).__module__), "mamba_chunk_scan_combined", None)


def _report_mamba1_scan(calls: LayerCalls) -> None:
    """A Mamba v1 scan on CUDA: zorro runs its torch scan (module docstring); warn once, count every layer call."""
    calls.fallbacks["mamba-ssm"] = calls.fallbacks.get("mamba-ssm", 0) + 1
    if "mamba-ssm-v1" not in _warned:
        _warned.add("mamba-ssm-v1")
        warnings.warn("zorro: on GPU the Mamba (v1) scan runs zorro's torch scan (exact, slower): mamba-ssm's "
                      "selective_scan_fn takes no initial state, so a response cannot start from its prompt's state "
                      "in it.", RuntimeWarning, stacklevel=3)


def zorro_mamba2_forward(self, hidden_states: torch.Tensor, cache_params=None, attention_mask=None,
                         zorro_ctx: StepContext | None = None, seq_idx=None, **kwargs) -> torch.Tensor:
    """The wrapped forward of a Mamba-2 mixer instance on the packed row.

    Under Ulysses sequence parallelism (``zorro_ctx.shard``) the token-wise projection and step size run on the
    rank's slice, the conv inputs and the step size are exchanged for head shards of the whole row (the attention
    layers' all-to-all; :func:`_exchange_to_heads`), the conv and the scan run there on the rank's heads, and the
    output comes back to the slice before the gated norm and ``out_proj``.

    Args:
        hidden_states: ``[1, T, hidden]`` (the packed dedup row; ``[1, L, hidden]``, this rank's slice, under SP).
        zorro_ctx: the step context (or the one its carriers set, module docstring).

    Returns:
        ``[1, T, hidden]`` (``[1, L, hidden]`` under SP) equal, token for token, to the mixer's output on each
        ordinary row ``[prompt|response]``: ``out_proj(norm(scan(x, dt, A, B, C) + D x, gate))`` with the conv and
        the scan of each response continuing from its prompt's (:func:`~zorro_verl.recurrent.packed_causal_conv`,
        :func:`~zorro_verl.recurrent.packed_ssd`).
    """
    ctx = zorro_ctx or self.__dict__.get("_zorro_layer_ctx") or self.__dict__.get("_zorro_root_ctx")
    ctx = require_context(ctx, "zorro Mamba-2 layer")
    if cache_params is not None:
        raise ValueError("zorro Mamba-2 layer: got a cache; zorro runs training forwards. Call the model with "
                         "use_cache=False.")
    if attention_mask is not None or seq_idx is not None:
        raise ValueError("zorro Mamba-2 layer: got an attention_mask / seq_idx; call the model without one (the plan "
                         "carries the structure).")
    plan, shard = ctx.plan, ctx.shard
    T = plan.T
    n = T if shard is None else shard.local_len
    if hidden_states.dim() != 3 or hidden_states.shape[0] != 1 or hidden_states.shape[1] != n:
        what = "one packed row" if shard is None else f"this rank's slice of {shard.sp_size}"
        raise ValueError(f"zorro Mamba-2 layer: expected hidden_states [1, {n}, hidden] ({what}), got "
                         f"{tuple(hidden_states.shape)}.")
    fused = stock_runs_fused(self, hidden_states)
    reason = fused_path_unsupported(self) if fused else None
    if reason is not None:
        raise ValueError(reason)
    if not fused and type(self).__name__ in _CHUNK_DEPENDENT_TORCH_PATH and plan.max_row_len > self.chunk_size:
        raise ValueError(
            f"model: {type(self).__name__} without mamba-ssm runs transformers' torch path, whose output is not the "
            f"Mamba-2 recurrence across its chunk_size = {self.chunk_size}-token chunks (it depends on where the "
            f"chunk boundaries fall); a row of {plan.max_row_len} tokens crosses one, so no deduplicated forward can "
            "equal the ordinary one. Install mamba-ssm and causal-conv1d (the fused CUDA path computes the "
            "recurrence), or keep rows within chunk_size tokens.")
    ctx.calls.recurrent += 1
    dtype = hidden_states.dtype
    gate, xBC, dt = mamba2_projections(self, hidden_states)  # [1, n, I], [1, n, conv_dim], [1, n, H]
    dt = ssm_step_size(self, dt, fused)  # [1, n, H]; token-wise, so before any exchange
    conv_fn = _conv_fn(self) if self.activation in ("silu", "swish") else None
    loaded_scan = _scan_fn(self)
    scan_fn = loaded_scan if fused else None  # the stock mixer's own scan kernel, where it runs fused
    if hidden_states.is_cuda:
        if loaded_scan is None:
            _report_fallback(ctx.calls, "mamba-ssm", "the Mamba-2 scan runs zorro's torch chunked kernel (exact, "
                             "slower)", "mamba-ssm")
        if conv_fn is None:
            _report_fallback(ctx.calls, "causal-conv1d", "the packed conv runs torch's conv1d (exact, a little slower)",
                             "causal-conv1d")
    weight, bias = self.conv1d.weight.squeeze(1), self.conv1d.bias  # [conv_dim, Kc], [conv_dim] | None
    H, P, G, N = self.num_heads, self.head_dim, self.n_groups, self.ssm_state_size
    xBC, dt = xBC[0], dt[0]
    heads = None
    if shard is not None:  # Ulysses: sequence shards -> head shards around the conv and the scan
        xBC, weight, bias, dt, heads, G = _exchange_to_heads(self, xBC, weight, bias, dt, shard)
        H = H // shard.sp_size
    if conv_fn is not None:
        xBC = packed_causal_conv(xBC, weight, bias, plan, activation="silu", causal_conv1d_fn=conv_fn)
    else:
        xBC = self.act(packed_causal_conv(xBC, weight, bias, plan))  # [T, conv_dim (this rank's channels)]
    x, B, C = torch.split(xBC, [H * P, G * N, G * N], dim=-1)
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    A, D = ssm_decay_rate(self, cdt), self.D
    if heads is not None:
        A, D = A[heads], D[heads]
    if scan_fn is not None:  # x, B, C in the model's dtype (the fused kernel loads them so; no fp32 copies)
        x = x.reshape(T, H, P)
        kernel = fused_ssd_kernel(scan_fn, self.chunk_size)
    else:
        x = x.reshape(T, H, P).to(cdt)
        kernel = functools.partial(chunk_ssd, chunk_size=self.chunk_size)
    y = packed_ssd(kernel, x, dt, A, B.reshape(T, G, N), C.reshape(T, G, N), plan)
    y = y.to(cdt) + D[:, None] * x.to(cdt)  # the skip term, token-wise, as the model adds it
    if shard is not None:
        y = heads_to_sequence(y, shard)  # [L, H, P]
    out = mamba2_gated_output(self, y.reshape(1, n, -1), gate)
    return self.out_proj(out.to(dtype))


def _exchange_to_heads(mod, xBC: torch.Tensor, weight: torch.Tensor, bias, dt: torch.Tensor, shard):
    """The Ulysses exchange of a Mamba-2 layer's sequence mixers' inputs (as the gated delta-net's, hybrid.py).

    The conv is depthwise and the scan runs per head (each head reading its group's ``B`` / ``C``), so both run
    unchanged on a subset of heads. Channels are ``[x (H P) | B (G N) | C (G N)]``, the conv weight's rows in the same
    order. When ``sp`` divides ``G`` each rank takes its heads' groups; otherwise ``B`` / ``C`` (and their conv
    channels) are repeated per head first, so every head carries its own copy.

    Args:
        xBC: ``[L, conv_dim]`` conv inputs of this rank's tokens; weight ``[conv_dim, Kc]``; bias ``[conv_dim]`` or
            None; dt ``[L, H]`` (before softplus: token-wise).

    Returns:
        ``(xBC [T, C_l], weight [C_l, Kc], bias [C_l] | None, dt [T, H/sp], heads [H/sp] int64, G_l)``: the whole
        deduplicated row for this rank's heads, their conv channels and weight rows, the rank's head indices and its
        number of ``B`` / ``C`` groups.
    """
    H, P, G, N, sp, r = mod.num_heads, mod.head_dim, mod.n_groups, mod.ssm_state_size, shard.sp_size, shard.rank
    reason = _sp_heads_unsupported(mod, sp)
    if reason is not None:
        raise ValueError(reason)
    L = xBC.shape[0]
    sizes = [H * P, G * N, G * N]
    x, B, C = torch.split(xBC, sizes, dim=-1)
    x, B, C = x.reshape(L, H, P), B.reshape(L, G, N), C.reshape(L, G, N)
    parts = [w.reshape(h, d, -1) for w, h, d in zip(torch.split(weight, sizes, dim=0), (H, G, G), (P, N, N))]
    if bias is not None:
        parts += [b.reshape(h, d) for b, h, d in zip(torch.split(bias, sizes), (H, G, G), (P, N, N))]
    if G % sp:  # fewer groups than ranks (or not divisible): one copy of its group per head
        rep = H // G
        B, C = B.repeat_interleave(rep, 1), C.repeat_interleave(rep, 1)
        parts = [p if i % 3 == 0 else p.repeat_interleave(rep, 0) for i, p in enumerate(parts)]
        G = H
    h_l, g_l = H // sp, G // sp
    x, B, C, dt = (sequence_to_heads(t, shard) for t in (x, B, C, dt))  # [T, H/sp or G/sp, ...]
    T = x.shape[0]
    own = [p[r * k:(r + 1) * k] for p, k in zip(parts, (h_l, g_l, g_l) * 2)]
    xBC = torch.cat([x.reshape(T, -1), B.reshape(T, -1), C.reshape(T, -1)], -1)
    weight = torch.cat([p.reshape(-1, p.shape[-1]) for p in own[:3]], 0)
    bias = torch.cat([p.reshape(-1) for p in own[3:]]) if bias is not None else None
    heads = torch.arange(r * h_l, (r + 1) * h_l, device=xBC.device)
    return xBC, weight, bias, dt, heads, g_l


# ---------------------------------------------------------------------------------------------------- Mamba v1
def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """FalconMamba's weightless ``rms_forward``: fp32 (fp64 kept) compute, back to the input dtype."""
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = x.to(dt)
    return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def mamba1_selection(mod, x: torch.Tensor):
    """The token-wise selection of a Mamba (v1) mixer as the model computes it: ``x [.., D]`` (after the conv) ->
    ``dt [.., D]`` (``softplus(dt_proj(.))``), ``B, C [.., N]`` — with FalconMamba's weightless RMS norms
    (``rms_eps``) or Jamba's ``dt`` / ``B`` / ``C`` layer norms on the way."""
    t, B, C = torch.split(mod.x_proj(x), [mod.time_step_rank, mod.ssm_state_size, mod.ssm_state_size], dim=-1)
    if hasattr(mod, "rms_eps"):  # FalconMamba
        B, C, t = _rms(B, mod.rms_eps), _rms(C, mod.rms_eps), _rms(t, mod.rms_eps)
    if hasattr(mod, "dt_layernorm"):  # Jamba
        t, B, C = mod.dt_layernorm(t), mod.b_layernorm(B), mod.c_layernorm(C)
    return F.softplus(mod.dt_proj(t)), B, C


def _mamba_v1_plan(mixer, hidden_states: torch.Tensor, cache_params, attention_mask, zorro_ctx, what: str):
    """The checks every Mamba (v1) mixer wrapper makes before its packed forward, and its plan: the step context
    (passed, or held for the call by the layer / root carrier), no cache or mask, no Ulysses shard (Mamba v1 has no
    SP path), ``hidden_states [1, T, hidden]`` the packed row; counts the recurrent call (and, on CUDA, the torch
    scan: module docstring). ``what`` names the layer in the messages."""
    ctx = zorro_ctx or mixer.__dict__.get("_zorro_layer_ctx") or mixer.__dict__.get("_zorro_root_ctx")
    ctx = require_context(ctx, what)
    if cache_params is not None or attention_mask is not None:
        raise ValueError(f"{what}: got a cache or an attention_mask; zorro runs training forwards on the packed row. "
                         "Call the model with use_cache=False and without a mask.")
    plan = ctx.plan
    if ctx.shard is not None:
        raise ValueError(f"ulysses_sequence_parallel_size: {_SP_REFUSAL}")
    T = plan.T
    if hidden_states.dim() != 3 or hidden_states.shape[0] != 1 or hidden_states.shape[1] != T:
        raise ValueError(f"{what}: expected hidden_states [1, {T}, hidden] (one packed row), got "
                         f"{tuple(hidden_states.shape)}.")
    ctx.calls.recurrent += 1
    if hidden_states.is_cuda:
        _report_mamba1_scan(ctx.calls)
    return plan


def zorro_mamba1_forward(self, hidden_states: torch.Tensor, cache_params=None, attention_mask=None,
                         zorro_ctx: StepContext | None = None, **kwargs) -> torch.Tensor:
    """The wrapped forward of a Mamba (v1) mixer instance on the packed row: ``out_proj((scan(x, dt, A, B, C) + D x)
    * act(gate))`` with the conv and the scan of each response continuing from its prompt's
    (:func:`~zorro_verl.recurrent.packed_causal_conv`, :func:`~zorro_verl.recurrent.packed_selective_scan`).

    Args: hidden_states ``[1, T, hidden]``. Returns ``[1, T, hidden]`` equal, token for token, to the mixer's output
    on each ordinary row. The scan runs step by step in torch (transformers' torch path does too); mamba-ssm's
    ``selective_scan_fn`` takes no initial state, so it is not used (warned and counted on CUDA).
    """
    plan = _mamba_v1_plan(self, hidden_states, cache_params, attention_mask, zorro_ctx, "zorro Mamba layer")
    dtype = hidden_states.dtype
    x, gate = self.in_proj(hidden_states)[0].chunk(2, dim=-1)  # [T, D] each
    x = self.act(packed_causal_conv(x, self.conv1d.weight.squeeze(1), self.conv1d.bias, plan))  # [T, D]
    dt, B, C = mamba1_selection(self, x)
    cdt = torch.float64 if dtype == torch.float64 else torch.float32
    y = packed_selective_scan(x, dt, -self.A_log.to(cdt).exp(), B, C, plan).to(dtype)  # [T, D]
    y = (y + x * self.D) * self.act(gate)
    return self.out_proj(y[None])


def zorro_zamba_forward(self, hidden_states: torch.Tensor, cache_params=None, attention_mask=None,
                        zorro_ctx: StepContext | None = None, **kwargs) -> torch.Tensor:
    """The wrapped forward of Zamba's multi-head Mamba (v1) mixer instance on the packed row: per head ``h`` of
    ``n_mamba_heads`` (its ``P = intermediate / heads`` channels), ``x_proj_weight[h]`` selects ``dt_rank | B | C``,
    ``dt = softplus(dt_proj_weight[h] t + dt_proj_bias[h])``, and the Mamba v1 scan runs over the head's channels
    with its own ``B`` / ``C`` (:func:`~zorro_verl.recurrent.packed_selective_scan` per head); then
    ``out_proj((y + D x) * act(gate))`` over the heads concatenated, as the model's ``slow_forward``.

    Args: hidden_states ``[1, T, hidden]``. Returns ``[1, T, hidden]`` equal, token for token, to the mixer's output
    on each ordinary row.
    """
    plan = _mamba_v1_plan(self, hidden_states, cache_params, attention_mask, zorro_ctx, "zorro Zamba Mamba layer")
    T, dtype = plan.T, hidden_states.dtype
    proj = self.in_proj(hidden_states)[0]  # [T, 2I]: the model views it as [I, 2]: x and gate interleaved
    x, gate = proj[:, 0::2], proj[:, 1::2]  # [T, I] each
    x = self.act(packed_causal_conv(x, self.conv1d.weight.squeeze(1), self.conv1d.bias, plan))  # [T, I]
    Hm, P, R, N = self.n_mamba_heads, self.mamba_head_dim, self.time_step_rank, self.ssm_state_size
    xh = x.reshape(T, Hm, P)
    sel = torch.einsum("hkp,thp->thk", self.x_proj_weight, xh)  # [T, Hm, R + 2N]
    t, B, C = torch.split(sel, [R, N, N], dim=-1)
    dt = F.softplus(torch.einsum("hpr,thr->thp", self.dt_proj_weight, t) + self.dt_proj_bias)  # [T, Hm, P]
    cdt = torch.float64 if dtype == torch.float64 else torch.float32
    A = -self.A_log.to(cdt).exp()  # [Hm, P, N]
    y = torch.stack([packed_selective_scan(xh[:, h], dt[:, h], A[h], B[:, h], C[:, h], plan) for h in range(Hm)],
                    1).to(dtype)  # [T, Hm, P]
    y = (y + xh * self.D) * self.act(gate.reshape(T, Hm, P))
    return self.out_proj(y.reshape(1, T, Hm * P))
