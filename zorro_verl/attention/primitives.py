"""Varlen attention primitives: a forward that returns the softmax log-sum-exp, and its backward.

The ``flash`` and ``flash_copyfree`` backends are written over these two functions (flash-attn vocabulary:
``cu_seqlens`` int32 ``[n+1]``, ``max_seqlen`` Python ints):

* ``fwd(q [Tq, Hq, D], k [Tk, Hkv, D], v, cu_q, cu_k, max_q, max_k, scale, causal, window=None, softcap=None)
  -> (out [Tq, Hq, D], lse [Hq, Tq] fp32, state)``;
* ``bwd(dout, q, k, v, out, lse [Hq, Tq], state, cu_q, cu_k, max_q, max_k, scale, causal, window=None,
  softcap=None) -> (dq, dk, dv)`` — the gradient of the attention whose softmax statistics are ``out``/``lse``
  (which may be merged ones).

Masks are aligned bottom-right (as flash-attn >= 2.1 does): with ``d = (i + lk - lq) - j`` for query ``i`` and key
``j`` of a segment, ``causal`` keeps ``d >= 0`` and ``window`` ``W`` keeps ``d < W`` (flash-attn's
``window_size = (W - 1, 0 | -1)``). A segment whose queries are the last ``lq`` of its keys' contiguous positions
(every call zorro makes) has ``d = pos_q - pos_k``: the window is transformers' ``pos_q - pos_k < W``. ``softcap``
``c`` turns scores into ``c * tanh(scores / c)`` (flash-attn >= 2.6; PyTorch's built-in kernels have none).

Providers: ``flash_attn`` (flash-attn 2's internal varlen fwd/bwd, imported lazily), ``torch`` (PyTorch's built-in
flash kernels, ``aten::_flash_attention_forward/backward``, CUDA sm80+; used when flash-attn is not installed, with
a one-time warning) and :func:`torch_primitives` (plain torch math per segment, any device and dtype incl. fp64:
the reference the tests plug in on CPU). ``ZORRO_FLASH_PROVIDER=flash_attn|torch`` forces one.
:func:`flash_available` is the package's one answer to "can the flash backends run here".
"""

from __future__ import annotations

import inspect
import os
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from zorro_verl.attention.features import add_sink, sink_grad

__all__ = ["VarlenPrimitives", "flash_available", "flash_primitives", "flash_provider", "torch_primitives",
           "cpu_flash_primitives", "lse_layout",
           "varlen_attention", "check_flash_inputs", "flash_deterministic", "DETERMINISTIC_ENV"]

_PRIMS: dict = {}
_WARNED: set = set()

#: flash-attn's (and verl's ``enable_full_determinism``'s, and transformers') switch for a deterministic backward.
DETERMINISTIC_ENV = "FLASH_ATTENTION_DETERMINISTIC"


def flash_deterministic() -> bool:
    """Whether the flash backward must be deterministic: ``FLASH_ATTENTION_DETERMINISTIC=1``, read at each backward
    call, as flash-attn's and transformers' own varlen calls read it."""
    return os.environ.get(DETERMINISTIC_ENV, "0") == "1"


@contextmanager
def _aten_deterministic(on: bool):
    """ATen's flash backward has no ``deterministic`` argument: it is deterministic only under
    ``torch.use_deterministic_algorithms(True, warn_only=False)`` (verl sets ``warn_only=True``). Switch that on
    around the one backward call and restore the previous mode."""
    enabled, warn_only = torch.are_deterministic_algorithms_enabled(), \
        torch.is_deterministic_algorithms_warn_only_enabled()
    if not on or (enabled and not warn_only):
        yield
        return
    torch.use_deterministic_algorithms(True, warn_only=False)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


@dataclass(frozen=True)
class VarlenPrimitives:
    """A varlen attention forward returning the softmax log-sum-exp, and its backward (see the module doc)."""

    name: str
    fwd: Callable
    bwd: Callable


# ------------------------------------------------------------------------------------------ torch reference math
def _segments(cu: torch.Tensor) -> list[tuple[int, int]]:
    c = cu.tolist()  # host sync: reference implementation only
    return list(zip(c[:-1], c[1:]))


def _allowed(lq: int, lk: int, causal: bool, device, window: Optional[int] = None) -> Optional[torch.Tensor]:
    """``[lq, lk]`` bool, bottom-right aligned: ``d = i + lk - lq - j``, causal ``d >= 0``, window ``d < W``; None
    when neither applies."""
    if not causal and window is None:
        return None
    i = torch.arange(lq, device=device)[:, None]
    j = torch.arange(lk, device=device)[None, :]
    d = i + (lk - lq) - j
    ok = d >= 0 if causal else torch.ones_like(d, dtype=torch.bool)
    return ok if window is None else ok & (d < window)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _segment_scores(q, k, v, qs_range, ks_range, rep: int, acc: torch.dtype, scale: float, causal: bool,
                    window: Optional[int], softcap: Optional[float]):
    """One (query segment, key segment) pair of the reference: ``qs [Hq, lq, D]``, ``ks/vs [Hq, lk, D]`` (kv heads
    repeated), masked (soft-capped) scores ``s [Hq, lq, lk]`` and the cap's derivative ``dcap`` (1 without a cap),
    all in ``acc``."""
    (a, b), (c, d) = qs_range, ks_range
    qs = q[a:b].transpose(0, 1).to(acc)
    ks = k[c:d].transpose(0, 1).to(acc).repeat_interleave(rep, 0)
    vs = v[c:d].transpose(0, 1).to(acc).repeat_interleave(rep, 0)
    s = qs @ ks.transpose(1, 2) * scale
    dcap = 1.0
    if softcap is not None:
        t = torch.tanh(s / softcap)
        s, dcap = t * softcap, 1.0 - t * t  # d(c tanh(x / c)) / dx
    m = _allowed(b - a, d - c, causal, q.device, window)
    if m is not None:
        s = s.masked_fill(~m, float("-inf"))
    return qs, ks, vs, s, dcap


def _torch_fwd(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window=None, softcap=None):
    Tq, Hq, D = q.shape
    rep = Hq // k.shape[1]
    acc = _acc_dtype(q.dtype)
    out = q.new_zeros(Tq, Hq, v.shape[2])
    lse = torch.full((Hq, Tq), float("-inf"), dtype=acc, device=q.device)
    for (a, b), (c, d) in zip(_segments(cu_q), _segments(cu_k)):
        if b == a or d == c:
            continue
        qs, ks, vs, s, _ = _segment_scores(q, k, v, (a, b), (c, d), rep, acc, scale, causal, window, softcap)
        ls = torch.logsumexp(s, -1)  # [Hq, lq]
        p = torch.exp(s - ls[..., None]).nan_to_num(0.0)  # fully masked rows (lse = -inf) give 0
        out[a:b] = (p @ vs).transpose(0, 1).to(q.dtype)
        lse[:, a:b] = ls
    return out, lse, None


def _torch_bwd(dout, q, k, v, out, lse, state, cu_q, cu_k, max_q, max_k, scale, causal, window=None, softcap=None):
    Hq, Hkv = q.shape[1], k.shape[1]
    rep = Hq // Hkv
    acc = _acc_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc, device=q.device)
    for (a, b), (c, d) in zip(_segments(cu_q), _segments(cu_k)):
        if b == a or d == c:
            continue
        qs, ks, vs, s, dcap = _segment_scores(q, k, v, (a, b), (c, d), rep, acc, scale, causal, window, softcap)
        do = dout[a:b].transpose(0, 1).to(acc)  # [Hq, lq, D]
        o = out[a:b].transpose(0, 1).to(acc)
        p = torch.exp(s - lse[:, a:b].to(acc)[..., None]).nan_to_num(0.0)  # [Hq, lq, lk] under the given lse
        delta = (do * o).sum(-1, keepdim=True)  # [Hq, lq, 1] = rowsum(dO * O) with the given (merged) O
        dp = do @ vs.transpose(1, 2)
        ds = p * (dp - delta) * dcap  # through the soft-cap: d/d(raw score)
        dq[a:b] += (ds @ ks).transpose(0, 1) * scale
        dk_h = (ds.transpose(1, 2) @ qs) * scale  # [Hq, lk, D] -> sum over the q heads of each kv head
        dv_h = p.transpose(1, 2) @ do
        dk[c:d] += dk_h.view(Hkv, rep, d - c, -1).sum(1).transpose(0, 1)
        dv[c:d] += dv_h.view(Hkv, rep, d - c, -1).sum(1).transpose(0, 1)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def torch_primitives() -> VarlenPrimitives:
    """Plain-torch varlen primitives (a loop over segments, fp32 softmax for half dtypes, fp64 kept): the
    reference the copy-free and gather logic are tested with on CPU."""
    return VarlenPrimitives("torch_reference", _torch_fwd, _torch_bwd)


# ------------------------------------------------------------------------------------------ CPU flash kernels
def _cpu_kernel_fits(segs_q, segs_k, causal: bool, window, softcap) -> bool:
    """Whether the CPU flash kernel computes this call: it has no window and no soft-cap, and its causal mask is
    top-left aligned, which equals this module's bottom-right one only where every segment is square (every causal
    call zorro makes). Otherwise the call runs the plain math (exact)."""
    if window is not None or softcap is not None:
        return False
    return not causal or all(b - a == d - c for (a, b), (c, d) in zip(segs_q, segs_k))


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """``[L, H, D] -> [1, H, L, D]`` (a view; the CPU kernels take strided inputs)."""
    return x.transpose(0, 1).unsqueeze(0)


def _cpu_fwd(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window=None, softcap=None):
    segs_q, segs_k = _segments(cu_q), _segments(cu_k)  # CPU tensors: reading them is no device sync
    if not _cpu_kernel_fits(segs_q, segs_k, causal, window, softcap):
        return _torch_fwd(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window, softcap)
    Tq, Hq, _ = q.shape
    out = q.new_zeros(Tq, Hq, v.shape[2])
    lse = torch.full((Hq, Tq), float("-inf"), dtype=_acc_dtype(q.dtype), device=q.device)
    for (a, b), (c, d) in zip(segs_q, segs_k):
        if b == a or d == c:  # no key: output 0, lse -inf (as the reference)
            continue
        o, ls = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _heads_first(q[a:b]), _heads_first(k[c:d]), _heads_first(v[c:d]), 0.0, causal, scale=scale)
        out[a:b] = o[0].transpose(0, 1)
        lse[:, a:b] = ls[0]
    return out, lse, None


def _cpu_bwd(dout, q, k, v, out, lse, state, cu_q, cu_k, max_q, max_k, scale, causal, window=None, softcap=None):
    segs_q, segs_k = _segments(cu_q), _segments(cu_k)
    if not _cpu_kernel_fits(segs_q, segs_k, causal, window, softcap):
        return _torch_bwd(dout, q, k, v, out, lse, state, cu_q, cu_k, max_q, max_k, scale, causal, window, softcap)
    acc = _acc_dtype(q.dtype)
    # cu_seqlens segments are disjoint ranges: each gradient row is written once, in the inputs' dtype (the kernel
    # accumulates in fp32 inside), with no full-size fp32 buffer beside a bf16 one; rows of empty segments stay 0
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for (a, b), (c, d) in zip(segs_q, segs_k):
        if b == a or d == c:
            continue
        # the kernel recomputes P = exp(S - lse) and rowsum(dO * O) from the given (possibly merged) out / lse
        g_q, g_k, g_v = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _heads_first(dout[a:b]), _heads_first(q[a:b]), _heads_first(k[c:d]), _heads_first(v[c:d]),
            _heads_first(out[a:b]), lse[:, a:b].unsqueeze(0).to(acc), 0.0, causal, scale=scale)
        dq[a:b] = g_q[0].transpose(0, 1)
        dk[c:d] = g_k[0].transpose(0, 1)
        dv[c:d] = g_v[0].transpose(0, 1)
    return dq, dk, dv


_CPU_FLASH = VarlenPrimitives("torch_cpu_flash", _cpu_fwd, _cpu_bwd)


def cpu_flash_primitives() -> VarlenPrimitives:
    """PyTorch's CPU flash-attention kernels (``aten::_scaled_dot_product_flash_attention_for_cpu`` and its
    backward: blockwise, no score matrix kept; fp64 / fp32 / bf16 / fp16, grouped K/V heads) called once per
    segment — the ``flash_copyfree`` backend's kernels on CPU. Calls with a window, a soft-cap or a non-square
    causal segment run :func:`torch_primitives`' math (the kernel has neither)."""
    return _CPU_FLASH


# ------------------------------------------------------------------------------------------ GPU providers
def _lse_rows(cu: torch.Tensor, Tq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(segment [Tq], position in segment [Tq])`` of every query row of a varlen call."""
    n = cu.numel() - 1
    seg = torch.repeat_interleave(torch.arange(n, device=cu.device), (cu[1:] - cu[:-1]).long(), output_size=Tq)
    return seg, torch.arange(Tq, device=cu.device) - cu.long()[seg]


def _lse_to_flat(lse: torch.Tensor, cu: torch.Tensor, Tq: int) -> torch.Tensor:
    """A kernel's lse -> ``[Hq, Tq]`` fp32: unpadded kernels return that already; older ones ``[n, Hq, max_q]``."""
    if lse.dim() == 2 and lse.shape[1] == Tq:
        return lse
    seg, local = _lse_rows(cu, Tq)
    return lse[seg, :, local].transpose(0, 1)


def lse_layout(lse: torch.Tensor, Tq: int) -> Optional[torch.Size]:
    """What a backward needs of a kernel's own lse besides the flat one: None when the kernel returns the flat
    ``[Hq, Tq]`` layout already, else its padded shape (older kernels: ``[n, Hq, max_q]``). A forward keeps this in
    its state instead of the tensor: a copy-free call's parts would otherwise each keep a ``[Hq, Tq]`` fp32 lse
    beside the merged one until the backward (docs/DESIGN.md §2, memory)."""
    return None if lse.dim() == 2 and lse.shape[1] == Tq else lse.shape


def _lse_from_flat(flat: torch.Tensor, layout: Optional[torch.Size], cu: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_lse_to_flat` into the kernel's own layout (:func:`lse_layout`)."""
    if layout is None:
        return flat.contiguous()
    seg, local = _lse_rows(cu, flat.shape[1])
    out = flat.new_zeros(layout)
    out[seg, :, local] = flat.transpose(0, 1)
    return out


def _aten_primitives() -> VarlenPrimitives:
    """PyTorch's built-in flash kernels (FlashAttention-2 inside ATen), CUDA only."""
    ops = torch.ops.aten

    def window_kw(causal, window, softcap):
        if softcap is not None:
            raise ValueError("attention backend 'flash'/'flash_copyfree': this model soft-caps attention logits and "
                             "PyTorch's built-in flash kernels have no soft-capping. Install flash-attn >= 2.6 "
                             "(`pip install zorro-verl[flash]`) or use attention backend 'sdpa'.")
        if window is None:
            return {}
        return {"window_size_left": window - 1, "window_size_right": 0 if causal else -1}

    def fwd(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window=None, softcap=None):
        out, lse, rng, unused, _ = ops._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale, **window_kw(causal, window, softcap))
        return out, _lse_to_flat(lse, cu_q, q.shape[0]), (lse_layout(lse, q.shape[0]), rng, unused)

    def bwd(dout, q, k, v, out, lse, state, cu_q, cu_k, max_q, max_k, scale, causal, window=None, softcap=None):
        layout, rng, unused = state
        with _aten_deterministic(flash_deterministic()):
            dq, dk, dv = ops._flash_attention_backward(
                dout.contiguous(), q, k, v, out, _lse_from_flat(lse, layout, cu_q), cu_q, cu_k, max_q, max_k, 0.0,
                causal, rng, unused, scale=scale, **window_kw(causal, window, softcap))
        return dq, dk, dv

    return VarlenPrimitives("torch", fwd, bwd)


def _flash_attn_primitives() -> VarlenPrimitives:
    """flash-attn 2's internal varlen forward/backward (their keyword names differ across 2.x: inspected)."""
    from flash_attn import flash_attn_interface as fai

    f_fwd, f_bwd = fai._flash_attn_varlen_forward, fai._flash_attn_varlen_backward

    def params_of(f) -> set:
        # >= 2.7 wraps them in torch.library custom ops: read the original function's signature
        return set(inspect.signature(getattr(f, "_init_fn", None) or getattr(f, "__wrapped__", None) or f).parameters)

    fwd_params, bwd_params = params_of(f_fwd), params_of(f_bwd)

    def common(params, causal, scale, window, softcap):
        if softcap is not None and "softcap" not in params:
            raise ValueError("attention backend 'flash'/'flash_copyfree': this model soft-caps attention logits and "
                             "the installed flash-attn has no soft-capping. Install flash-attn >= 2.6 or use "
                             "attention backend 'sdpa'.")
        kw = {"dropout_p": 0.0, "softmax_scale": scale, "causal": causal, "softcap": softcap or 0.0,
              "alibi_slopes": None, "block_table": None}
        # flash-attn's window: key j of query i (bottom-right aligned) iff i + lk - lq - left <= j <= ... + right
        left, right = (-1, -1) if window is None else (window - 1, 0 if causal else -1)
        if "window_size" in params:
            kw["window_size"] = (left, right)
        else:
            kw.update(window_size_left=left, window_size_right=right)
        return {k: val for k, val in kw.items() if k in params}

    def fwd(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window=None, softcap=None):
        kw = common(fwd_params, causal, scale, window, softcap)
        if "return_softmax" in fwd_params:
            kw["return_softmax"] = False
        ret = f_fwd(q, k, v, cu_q, cu_k, max_q, max_k, **kw)
        if len(ret) == 4:  # 2.6+: out, lse, S_dmask, rng_state
            out, lse, rng = ret[0], ret[1], ret[3]
        else:  # <= 2.5: out, q, k, v, out_padded, lse, S_dmask, rng_state
            out, lse, rng = ret[0], ret[5], ret[7]
        return out, _lse_to_flat(lse, cu_q, q.shape[0]), (lse_layout(lse, q.shape[0]), rng)

    def bwd(dout, q, k, v, out, lse, state, cu_q, cu_k, max_q, max_k, scale, causal, window=None, softcap=None):
        layout, rng = state
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        kw = common(bwd_params, causal, scale, window, softcap)
        kw["deterministic"] = flash_deterministic()
        kw["rng_state"] = rng
        kw = {k2: val for k2, val in kw.items() if k2 in bwd_params}
        f_bwd(dout.contiguous(), q, k, v, out, _lse_from_flat(lse, layout, cu_q), dq, dk, dv, cu_q, cu_k, max_q,
              max_k, **kw)
        return dq, dk, dv

    return VarlenPrimitives("flash_attn", fwd, bwd)


def flash_provider() -> Optional[str]:
    """Which flash kernels :func:`flash_primitives` uses here: ``flash_attn``, ``torch`` or None (no CUDA kernels)."""
    forced = os.environ.get("ZORRO_FLASH_PROVIDER")
    if forced:
        if forced not in ("flash_attn", "torch"):
            raise ValueError(f"ZORRO_FLASH_PROVIDER: expected 'flash_attn' or 'torch', got {forced!r}.")
        return forced
    try:
        from flash_attn import flash_attn_interface as fai

        if hasattr(fai, "_flash_attn_varlen_forward") and hasattr(fai, "_flash_attn_varlen_backward"):
            return "flash_attn"
    except ImportError:
        pass
    if torch.cuda.is_available() and getattr(torch.backends.cuda, "is_flash_attention_available", lambda: False)():
        return "torch"
    return None


def flash_available(device) -> bool:
    """The one answer to "can the flash backends run on ``device``": a CUDA device and a flash provider
    (flash-attn, or PyTorch's built-in flash kernels)."""
    return torch.device(device).type == "cuda" and flash_provider() is not None


def flash_primitives() -> VarlenPrimitives:
    """The GPU varlen primitives (see :func:`flash_provider`). Raises ImportError naming the extra if none."""
    name = flash_provider()
    if name is None:
        raise ImportError("attention backend 'flash': no flash kernels here — neither flash-attn (install the extra "
                          "`pip install zorro-verl[flash]`, CUDA only) nor PyTorch's built-in CUDA flash attention. "
                          "Choose attention backend 'sdpa' (attn_implementation='sdpa') or 'flex'.")
    if name not in _PRIMS:
        if name == "torch" and "torch" not in _WARNED:
            _WARNED.add("torch")
            warnings.warn("zorro flash backends: flash-attn is not installed; using PyTorch's built-in flash "
                          "kernels (aten::_flash_attention_forward/backward, FlashAttention-2).", stacklevel=2)
        _PRIMS[name] = _flash_attn_primitives() if name == "flash_attn" else _aten_primitives()
    return _PRIMS[name]


def check_flash_inputs(name: str, query: torch.Tensor) -> None:
    """The flash kernels take fp16/bf16 CUDA tensors only: a clear error naming the backend otherwise."""
    if query.device.type != "cuda" or query.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"attention backend '{name}': expected fp16/bf16 CUDA tensors, got {query.dtype} on "
                         f"{query.device}. Use attention backend 'sdpa' (or 'eager') on CPU or in fp32/fp64.")


# ------------------------------------------------------------------------------------------ one varlen call
class _VarlenAttention(torch.autograd.Function):
    """One varlen attention call over primitives, differentiable: ``q [Tq, Hq, D], k/v [Tk, Hkv, D] -> out``, with
    the layer's window / soft-cap passed to the kernels and its sinks (``[Hq]`` or None) merged into the result."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, cu_q, cu_k, max_q, max_k, scale, causal, window, softcap, prims):
        out, lse, state = prims.fwd(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window, softcap)
        out, lse = add_sink(out, lse, sinks)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, sinks)
        ctx.args = (state, max_q, max_k, scale, causal, window, softcap, prims)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu_q, cu_k, sinks = ctx.saved_tensors
        state, max_q, max_k, scale, causal, window, softcap, prims = ctx.args
        # the kernel backward under the statistics with the sink: exact dq/dk/dv (docs/design/attention.md)
        dq, dk, dv = prims.bwd(dout, q, k, v, out, lse, state, cu_q, cu_k, max_q, max_k, scale, causal, window,
                               softcap)
        ds = sink_grad(dout, out, lse, sinks) if sinks is not None and ctx.needs_input_grad[3] else None
        return dq, dk, dv, ds, None, None, None, None, None, None, None, None, None


def varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, prims: VarlenPrimitives, *,
                     window: Optional[int] = None, softcap: Optional[float] = None,
                     sinks: Optional[torch.Tensor] = None):
    """Differentiable varlen attention over ``prims``. ``q [Tq, Hq, D]``, ``k/v [Tk, Hkv, D]`` -> ``[Tq, Hq, D]``;
    ``window`` / ``softcap`` as in the module doc, ``sinks [Hq]`` merged once per query."""
    return _VarlenAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), sinks, cu_q, cu_k, max_q, max_k,
                                  scale, causal, window, softcap, prims)
