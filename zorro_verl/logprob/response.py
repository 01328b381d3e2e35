"""Response-only log-probs and entropy from hidden states at response-predicting rows (docs/design/logprob.md).
Imports torch only.

``logits_optimization`` (the one name of this knob in the API, the verl config and here):

* ``none``    — materialise ``[N, V]`` logits once (the head's dtype); the softmax / entropy follow-up in row blocks
  of at most ``chunk_size`` and at most ``ceil(N / LEAN_BLOCKS)`` rows, so its fp32 temporaries stay a fraction of
  the logits' own bytes whatever ``N`` (the default mode);
* ``compute`` — the same computation (it used to differ by running blocks of exactly ``chunk_size`` rows, all rows
  at once when ``N <= chunk_size``: more bytes than stock's path in bf16; the name is kept for existing configs);
* ``memory``  — an autograd Function over the head's ``weight`` / ``bias`` that never holds more than one
  ``[chunk, V]`` block of logits, recomputed in backward (:func:`linear_logprobs`); its softmax work runs in row
  blocks of 1/LEAN_BLOCKS of the chunk, as in ``none``.

Rows shared by several outputs (a prefix tree's shared response tokens): every mode also takes ``index [N]``, each
output's row among ``Nh`` distinct rows; the head / softmax statistics then run once per distinct row
(:class:`_SharedLogitsLogprob`, :class:`_SharedLinearLogprob`).

``none`` and ``compute`` run :class:`_LogitsLogprob`: for backward it keeps only the logits in their own dtype plus
``[N]`` fp32 statistics, never an upcast copy or a softmax. :func:`logprobs_from_logits` is the plain reference
(autograd through log-softmax and softmax) the tests compare every mode with.

Logits are computed in the hidden dtype and the softmax in at least fp32 (fp64 stays fp64).
Entropy is ``lse - sum(softmax * logits)``.

A float ``temperature`` divides the logits as ``temperature_op`` says (:data:`TEMPERATURE_OPS`): after the upcast
(``upcast``, the default), or in the logits' own dtype, rounded there as verl rounds it (``logits``: verl 0.7's
``logits.div_(temperature)``; ``logits_rounded``: verl 0.9's engine, ``logits / temperature.to(logits.dtype)``).
The three are the same operation for fp32 / fp64 logits; in bf16 they differ by bf16 roundings of ``z / T``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["LOGITS_MODES", "DEFAULT_CHUNK", "LEAN_BLOCKS", "TEMPERATURE_OPS", "check_logits_optimization",
           "check_temperature_op", "response_logprobs", "logits_logprobs", "logprobs_from_logits", "linear_logprobs",
           "linear_head_params", "scaled_logits", "unscaled_grad"]

#: Values of ``logits_optimization``.
LOGITS_MODES = ("none", "compute", "memory")
#: Rows per chunk of the ``memory`` mode, and the most rows per block of the materialised modes: ``[1024, V]`` fp32
#: is 0.6 GB at Qwen3's V = 151,936.
DEFAULT_CHUNK = 1024
#: Modes ``none`` / ``compute`` split their rows into at least this many blocks (of at most ``chunk_size`` rows):
#: their fp32 temporaries (two ``[block, V]`` fp32 in forward, two to three in backward) are then at most 0.5
#: (forward) / 0.75 (backward) bytes per logits element, against the bf16 logits' own 2 (docs/BENCHMARKS.md).
LEAN_BLOCKS = 16
#: Values of ``temperature_op``: where a float temperature divides the logits (see the module doc).
TEMPERATURE_OPS = ("upcast", "logits", "logits_rounded")


def check_logits_optimization(value) -> str:
    """``value`` if it is one of :data:`LOGITS_MODES`, else a ``ValueError`` naming the choices."""
    if value not in LOGITS_MODES:
        raise ValueError(f"logits_optimization: expected one of {LOGITS_MODES}, got {value!r}.")
    return value


def _softmax_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                         calculate_entropy: bool,
                         temperature_op: str = "upcast") -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The plain reference: ``logits [n, V]``, ``targets [n] int64`` -> ``(log_probs [n], entropy [n] | None)`` in
    fp32 (fp64 for fp64), the temperature applied as ``temperature_op`` says (:func:`_scaled`). Autograd keeps the
    upcast logits and the softmax ``[n, V]``: the oracle of the tests, not the shipped path
    (:class:`_LogitsLogprob`)."""
    logits = _scaled(logits, temperature, check_temperature_op(temperature_op))
    lse = torch.logsumexp(logits, dim=-1)  # [n]
    logp = logits.gather(-1, targets[:, None]).squeeze(-1) - lse
    ent = None
    if calculate_entropy:
        ent = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return logp, ent


def check_temperature_op(value) -> str:
    """``value`` if it is one of :data:`TEMPERATURE_OPS`, else a ``ValueError`` naming the choices."""
    if value not in TEMPERATURE_OPS:
        raise ValueError(f"temperature_op: expected one of {TEMPERATURE_OPS}, got {value!r}.")
    return value


def _rounded_temperature(like: torch.Tensor, temperature: float) -> torch.Tensor:
    """``temperature`` as verl 0.9's engine divides by it: an fp32 value cast to the dtype of ``like`` (a 0-dim
    tensor on ``like``'s device, filled there: no host-to-device copy)."""
    return like.new_full((), temperature, dtype=torch.float32).to(like.dtype)


def _scaled(z_raw: torch.Tensor, temperature: float, op: str) -> torch.Tensor:
    """``z_raw [..]`` logits in their own dtype -> ``z / temperature`` in the softmax dtype (fp32; fp64 for fp64),
    divided where ``op`` says: ``upcast``: ``z_raw.to(sd) / temperature``; ``logits``: ``(z_raw / temperature)
    .to(sd)`` (the quotient rounded to ``z_raw``'s dtype, verl 0.7's ``div_``); ``logits_rounded``: ``(z_raw /
    temperature.to(z_raw.dtype)).to(sd)`` (verl 0.9's engine). Elementwise, so gathering before it is the same.
    No copy for fp32 / fp64 logits at temperature 1."""
    sd = _softmax_dtype(z_raw.dtype)
    if temperature == 1.0:
        return z_raw.to(sd)
    if op == "upcast":
        return z_raw.to(sd) / temperature
    if op == "logits":
        return (z_raw / temperature).to(sd)
    return (z_raw / _rounded_temperature(z_raw, temperature)).to(sd)


def _unscaled_grad(grad: torch.Tensor, dtype: torch.dtype, temperature: float, op: str) -> torch.Tensor:
    """The gradient w.r.t. ``z_raw`` (``dtype``) from the gradient ``grad`` (softmax dtype, a temporary of the
    caller: overwritten) w.r.t. :func:`_scaled`'s result, in the operations autograd runs through it: ``upcast``:
    divide, then cast; ``logits`` / ``logits_rounded``: cast, then divide in ``dtype``."""
    if temperature == 1.0:
        return grad.to(dtype)
    if op == "upcast":
        return grad.div_(temperature).to(dtype)
    g = grad.to(dtype)
    return g.div_(temperature if op == "logits" else _rounded_temperature(g, temperature))


def scaled_logits(z_raw: torch.Tensor, temperature: float, op: str) -> torch.Tensor:
    """Logits divided by the temperature where ``op`` says, in the softmax dtype: the one operation every mode runs
    (for log-prob code outside this module, e.g. megatron's vocabulary-parallel head). ``z_raw [..]`` -> ``[..]``."""
    return _scaled(z_raw, temperature, check_temperature_op(op))


def unscaled_grad(grad: torch.Tensor, dtype: torch.dtype, temperature: float, op: str) -> torch.Tensor:
    """The gradient w.r.t. the raw logits (``dtype``) from ``grad`` w.r.t. :func:`scaled_logits`' result, in the
    operations autograd runs through it (``grad`` may be overwritten)."""
    return _unscaled_grad(grad, dtype, temperature, check_temperature_op(op))


def _lean_chunk(n: int, chunk: int) -> int:
    """Rows per block of modes ``none`` / ``compute`` for ``n`` rows: at most ``chunk``, ``ceil(n / LEAN_BLOCKS)``."""
    return max(1, min(chunk, -(-n // LEAN_BLOCKS)))


def _rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a, b [c, V]`` -> ``[c]`` row-wise dot products, without a ``[c, V]`` product temporary."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


def _chunk_stats(z_raw: torch.Tensor, targets: Optional[torch.Tensor], temperature: float,
                 calculate_entropy: bool, op: str = "upcast"):
    """One chunk's statistics. ``z_raw [c, V]`` logits in their own dtype, ``targets [c] int64`` ->
    ``(log_probs [c], entropy [c] | None, lse [c], s [c] | None)`` in the softmax dtype (fp32; fp64 for fp64), where
    ``lse = logsumexp(z)``, ``s = sum(softmax(z) * z)`` and ``z = _scaled(z_raw, temperature, op)``.
    The formulas of :func:`logprobs_from_logits` (``s`` as ``sum(exp(z - max) * z) / sum(exp(z - max))``); two
    ``[c, V]`` temporaries in the softmax dtype (the upcast ``z`` and ``exp(z - max)``), for this chunk only.
    ``targets=None`` (rows shared by several outputs): no log-probs (None)."""
    z = _scaled(z_raw, temperature, op)  # no copy for fp32 / fp64 logits at temperature 1
    # logsumexp as torch.logsumexp computes it (max-shifted, an infinite max taken as 0), keeping exp(z - max):
    # one [c, V] temporary beside z where torch.logsumexp holds two, and the softmax for the entropy from it
    m = z.amax(-1, keepdim=True)  # [c, 1]
    m.masked_fill_(m.isinf(), 0)
    e = (z - m).exp_()  # [c, V]
    sum_e = e.sum(-1)  # [c]
    lse = sum_e.log() + m.squeeze(-1)  # [c]
    logp = None if targets is None else z.gather(-1, targets[:, None]).squeeze(-1) - lse
    if not calculate_entropy:
        return logp, None, lse, None
    s = _rowdot(e, z).div_(sum_e)  # softmax(z) . z   [c]
    return logp, lse - s, lse, s


def _chunk_grad(z_raw: torch.Tensor, targets: torch.Tensor, temperature: float, lse: torch.Tensor,
                s: Optional[torch.Tensor], g_lp: Optional[torch.Tensor], g_ent: Optional[torch.Tensor],
                owned: bool = False, pairs: Optional[tuple] = None, op: str = "upcast") -> torch.Tensor:
    """Gradient w.r.t. one chunk of logits ``z_raw [c, V]`` (returned in ``z_raw``'s dtype) of
    ``sum(g_lp * log_probs) + sum(g_ent * entropy)``, from the forward's ``lse [c]`` and ``s [c]``:
    ``d logp / dz = onehot(target) - p``, ``d entropy / dz = -p * (z - s)``, ``p = exp(z - lse)``,
    ``z = _scaled(z_raw, temperature, op)``; divided by the temperature and cast back as autograd does through the
    reference's division and upcast (:func:`_unscaled_grad`). ``owned``: ``z_raw`` is a temporary of the caller
    and may be overwritten (two ``[c, V]`` fp32 temporaries instead of three).
    ``pairs = (rows [n], cols [n], g [n])``: rows shared by several outputs (:class:`_SharedLogitsLogprob`): ``g_lp``
    is then each row's summed gradient and the one-hot part is scattered at ``(rows, cols)`` instead of the
    targets."""
    z = _scaled(z_raw, temperature, op)
    owned = owned or z is not z_raw
    p = (z - lse[:, None]).exp_()  # [c, V] softmax
    if g_ent is not None:
        coef = (z.sub_(s[:, None]) if owned else z - s[:, None]).mul_(g_ent[:, None])  # [c, V]
        del z
        if g_lp is not None:
            coef.add_(g_lp[:, None])
        grad = p.mul_(coef).neg_()
        del coef
    elif g_lp is not None:
        grad = p.mul_(g_lp[:, None]).neg_()
    else:
        grad = p.zero_()
    if pairs is not None:
        grad.index_put_(pairs[:2], pairs[2].to(grad.dtype), accumulate=True)
    elif g_lp is not None:
        grad.scatter_add_(-1, targets[:, None], g_lp[:, None].to(grad.dtype))
    return _unscaled_grad(grad, z_raw.dtype, temperature, op)


def _chunks(n: int, chunk: int):
    return [(s, min(s + chunk, n)) for s in range(0, n, chunk)]


def _chunked_stats(logits: torch.Tensor, targets: Optional[torch.Tensor], temperature: float,
                   calculate_entropy: bool, chunk: int, op: str):
    """:func:`_chunk_stats` over row chunks of ``logits [n, V]`` -> ``(log_probs [n] | None, entropy [n] ([0]
    without entropy), lse [n], s [n] | None)`` in the softmax dtype; ``targets=None``: no log-probs."""
    n, sd = logits.shape[0], _softmax_dtype(logits.dtype)
    logp = None if targets is None else logits.new_empty(n, dtype=sd)
    lse = logits.new_empty(n, dtype=sd)
    ent = logits.new_empty(n if calculate_entropy else 0, dtype=sd)
    s = logits.new_empty(n, dtype=sd) if calculate_entropy else None
    for a, b in _chunks(n, chunk):
        lp_c, en_c, lse[a:b], s_c = _chunk_stats(logits[a:b], None if targets is None else targets[a:b],
                                                 temperature, calculate_entropy, op)
        if logp is not None:
            logp[a:b] = lp_c
        if calculate_entropy:
            ent[a:b], s[a:b] = en_c, s_c
    return logp, ent, lse, s


class _LogitsLogprob(torch.autograd.Function):
    """Modes ``none`` / ``compute``: ``logits [N, V]`` (any float dtype) -> ``(log_probs [N], entropy [N])`` in the
    softmax dtype, row chunk by row chunk. Saves for backward only the logits themselves (their own dtype, no
    upcast copy) plus ``lse [N]`` and ``s [N]``; backward rebuilds the softmax one ``[chunk, V]`` block at a time and
    writes the gradient ``[N, V]`` in the logits' dtype. The oracle is :func:`logprobs_from_logits`."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, calculate_entropy, chunk, op):
        logp, ent, lse, s = _chunked_stats(logits, targets, temperature, calculate_entropy, chunk, op)
        ctx.save_for_backward(logits, targets, lse, s)
        ctx.temperature, ctx.chunk, ctx.op = temperature, chunk, op
        if not calculate_entropy:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        logits, targets, lse, s = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None, None
        if s is None:
            g_ent = None
        spans = _chunks(logits.shape[0], ctx.chunk)
        grad = torch.empty_like(logits) if len(spans) != 1 else None  # one chunk: its gradient is the gradient
        for a, b in spans:
            g = _chunk_grad(logits[a:b], targets[a:b], ctx.temperature, lse[a:b], None if s is None else s[a:b],
                            None if g_lp is None else g_lp[a:b], None if g_ent is None else g_ent[a:b], op=ctx.op)
            if grad is None:
                grad = g
            else:
                grad[a:b] = g
        return grad, None, None, None, None, None


class _SharedLogitsLogprob(torch.autograd.Function):
    """:class:`_LogitsLogprob` for logits shared by several outputs (a prefix tree's shared tokens): ``logits
    [Nh, V]`` (one row per distinct position), ``index [N]`` (each output's row), ``targets [N]`` (each output's own
    token) -> ``(log_probs [N], entropy [N])``. The softmax statistics are computed once per row; an output's
    log-prob is ``z[index, target] / temperature - lse[index]``, the same operations as the reference. Backward:
    ``dz[u] = -p_u * (sum_{i -> u} g_lp_i + g_ent_u (z - s_u)) + sum_{i -> u} g_lp_i onehot(target_i)``."""

    @staticmethod
    def forward(ctx, logits, index, targets, temperature, calculate_entropy, chunk, op):
        _, _, lse, s = _chunked_stats(logits, None, temperature, calculate_entropy, chunk, op)
        logp, ent = _shared_outputs(_scaled(logits[index, targets], temperature, op), index, lse, s)
        ctx.save_for_backward(logits, index, targets, lse, s)
        ctx.temperature, ctx.chunk, ctx.op = temperature, chunk, op
        if not calculate_entropy:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        logits, index, targets, lse, s = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None, None, None
        n = logits.shape[0]
        g_row, g_ent_row = _row_grads(index, lse, s, g_lp, g_ent)
        grad = torch.empty_like(logits)
        for a, b in _chunks(n, ctx.chunk):
            grad[a:b] = _chunk_grad(logits[a:b], targets, ctx.temperature, lse[a:b],
                                    None if s is None else s[a:b], None if g_row is None else g_row[a:b],
                                    None if g_ent_row is None else g_ent_row[a:b],
                                    pairs=_chunk_pairs(index, targets, g_lp, lse.dtype, a, b), op=ctx.op)
        return grad, None, None, None, None, None, None


def _shared_outputs(z_t: torch.Tensor, index: torch.Tensor, lse: torch.Tensor, s: Optional[torch.Tensor]):
    """``(log_probs [N], entropy [N] | empty)`` of outputs reading rows ``index [N]`` from each output's target logit
    ``z_t [N]`` and the rows' ``lse [Nh]`` / ``s [Nh] | None`` (softmax dtype)."""
    logp = z_t - lse[index]
    return logp, ((lse - s)[index] if s is not None else lse.new_empty(0))


def _row_grads(index: torch.Tensor, lse: torch.Tensor, s: Optional[torch.Tensor], g_lp: Optional[torch.Tensor],
               g_ent: Optional[torch.Tensor]):
    """The outputs' gradients ``g_lp [N]`` / ``g_ent [N]`` (or None) summed per row of ``index [N]`` -> ``([Nh] |
    None, [Nh] | None)`` in the softmax dtype of ``lse [Nh]``; the entropy's is None without ``s`` (no entropy)."""
    def per_row(g):
        return torch.zeros_like(lse).index_add_(0, index, g.to(lse.dtype))

    return (None if g_lp is None else per_row(g_lp)), (None if s is None or g_ent is None else per_row(g_ent))


def _chunk_pairs(index: torch.Tensor, targets: torch.Tensor, g_lp: Optional[torch.Tensor], sd: torch.dtype, a: int,
                 b: int) -> Optional[tuple]:
    """The one-hot parts of the log-prob gradient in the chunk of rows ``[a, b)``: ``(rows [N], cols [N], g [N])`` for
    :func:`_chunk_grad`, the outputs whose row lies outside the chunk adding 0 at row 0 (masks, not a host-side
    selection: no host sync), or None without a log-prob gradient."""
    if g_lp is None:
        return None
    sel = (index >= a) & (index < b)
    return torch.where(sel, index - a, 0), targets, torch.where(sel, g_lp.to(sd), 0)


def _autocast_state(device_type: str):
    return (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))


class _ChunkedLinearLogprob(torch.autograd.Function):
    """Memory mode: ``hidden [N, H]``, head ``weight [V, H]`` and ``bias [V] | None`` ->
    ``(log_probs [N], entropy [N])`` holding one ``[chunk, V]`` block of logits at a time (the head's dtype; the
    softmax work on it in row blocks of 1/LEAN_BLOCKS of the chunk, and in backward its gradient written over it).

    Forward computes each chunk's logits with ``F.linear`` (the head's own computation) and keeps ``lse [N]`` and
    ``s [N]``; backward recomputes each chunk and returns the gradients of ``hidden``, ``weight`` and ``bias`` as the
    Function's outputs, so they reach the parameters through autograd (and FSDP2's post-backward reduction) like a
    plain ``nn.Linear``'s. The head module is never called: under FSDP2 its parameters are gathered once around the
    whole chunk loop (see ``zorro_step``). The weight / bias gradients of low-precision heads accumulate over chunks in
    fp32 (``[V, H]`` fp32 during this backward) and are cast once. The autocast state of the forward is replayed when
    the chunks are recomputed."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, calculate_entropy, chunk, op):
        outs = [_chunked_stats(F.linear(hidden[a:b], weight, bias), targets[a:b], temperature, calculate_entropy,
                               _lean_chunk(b - a, b - a), op)
                for a, b in _chunks(hidden.shape[0], chunk)]  # [(logp [c], ent [c] | [0], lse [c], s [c] | None)]
        empty = hidden.new_empty(0, dtype=outs[0][0].dtype if outs else _softmax_dtype(hidden.dtype))

        def cat(i):
            return torch.cat([o[i] for o in outs]) if outs else empty

        logp, lse = cat(0), cat(2)
        ent, s = (cat(1), cat(3)) if calculate_entropy else (empty, None)
        return _linear_forward_done(ctx, (hidden, weight, bias, targets, lse, s), temperature, chunk, op, logp, ent,
                                    calculate_entropy)

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, bias, targets, lse, s = ctx.saved_tensors
        if s is None:
            g_ent = None

        def block_grad(z, a, b):
            return _chunk_grad(z, targets[a:b], ctx.temperature, lse[a:b], None if s is None else s[a:b],
                               None if g_lp is None else g_lp[a:b], None if g_ent is None else g_ent[a:b], owned=True,
                               op=ctx.op)

        return (*_linear_backward(ctx, hidden, weight, bias, block_grad), None, None, None, None, None)


def _linear_forward_done(ctx, saved: tuple, temperature: float, chunk: int, op: str, logp: torch.Tensor,
                         ent: torch.Tensor, calculate_entropy: bool):
    """End of a memory-mode forward: save ``saved`` (``hidden`` first) and what :func:`_linear_backward` reads
    (temperature, chunk, temperature op, the autocast state to replay); return ``(logp, ent)``, ``ent``
    non-differentiable when not computed."""
    ctx.save_for_backward(*saved)
    ctx.temperature, ctx.chunk, ctx.op = temperature, chunk, op
    ctx.autocast = _autocast_state(saved[0].device.type)
    if not calculate_entropy:
        ctx.mark_non_differentiable(ent)
    return logp, ent


def _linear_backward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], block_grad):
    """The memory mode's backward over the chunks of ``hidden [n, H]`` rows (``ctx.chunk`` rows each): recompute each
    chunk's logits ``z [c, V]`` once under the forward's autocast state and overwrite them, row block by row block
    (:func:`_lean_chunk` of the chunk: fp32 temporaries for 1/LEAN_BLOCKS of it), with the gradient w.r.t. them,
    ``block_grad(z[a:b], a, b)`` for the rows ``[a, b)`` of ``hidden`` (may overwrite its argument; returns the
    block's gradient in ``z``'s dtype); return ``(grad hidden [n, H] | None, grad weight [V, H] | None, grad bias
    [V] | None)`` as ``ctx.needs_input_grad[:3]`` asks; weight / bias gradients of several chunks sum in fp32
    (fp64) and are cast once."""
    need_h, need_w, need_b = ctx.needs_input_grad[:3]
    need_b = need_b and bias is not None
    n = hidden.shape[0]
    spans = _chunks(n, ctx.chunk)
    enabled, ac_dtype = ctx.autocast
    grad_h = torch.empty_like(hidden) if need_h else None
    grad_w = grad_b = w_c = None  # weight / bias gradients: one chunk's, or the fp32 (fp64) sums over chunks
    for a, b in spans:
        h = hidden[a:b]
        with torch.autocast(hidden.device.type, dtype=ac_dtype, enabled=enabled):
            g = F.linear(h, weight, bias)  # [c, V], the forward's dtype: the logits, then their gradient
        for sa, sb in _chunks(b - a, _lean_chunk(b - a, b - a)):
            g[sa:sb] = block_grad(g[sa:sb], a + sa, a + sb)
        if w_c is None:
            w_c = weight.to(g.dtype)  # the autocast copy of the forward (no copy without autocast)
        h = h.to(g.dtype)
        if need_h:
            grad_h[a:b] = g @ w_c
        acc = g.dtype if len(spans) == 1 else _softmax_dtype(g.dtype)
        if need_w:  # [V, H]; later chunks accumulate in place (addmm_: no [V, H] product per chunk)
            g_t, h_c = (g.t(), h) if acc == g.dtype else (g.t().to(acc), h.to(acc))
            grad_w = g_t @ h_c if grad_w is None else grad_w.addmm_(g_t, h_c)
        if need_b:  # [V]
            gb = g.sum(0, dtype=acc)
            grad_b = gb if grad_b is None else grad_b.add_(gb)
    if n == 0:  # no rows: zero gradients of the right shapes
        grad_w = torch.zeros_like(weight) if need_w else None
        grad_b = torch.zeros_like(bias) if need_b else None
    return (grad_h, None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(bias.dtype))


class _SharedLinearLogprob(torch.autograd.Function):
    """:class:`_ChunkedLinearLogprob` for hidden rows shared by several outputs (a prefix tree's shared response
    tokens): ``hidden [Nh, H]`` (one row per distinct position), head ``weight [V, H]`` / ``bias [V] | None``,
    ``index [N] int64`` (each output's row) and ``targets [N] int64`` (each output's own token) ->
    ``(log_probs [N], entropy [N])``.

    The head runs once per distinct row: each chunk of ``hidden``'s rows gets its logits from one ``F.linear``, its
    ``lse`` / ``s`` once per row, and the log-prob of every output whose row lies in the chunk as
    ``z[row, target] / temperature - lse[row]`` (the reference's operations); entropy is the row's ``lse - s``.
    Backward recomputes each chunk once: ``dz[u] = -p_u (sum_{i -> u} g_lp_i + g_ent_u (z - s_u)) + sum_{i -> u}
    g_lp_i onehot(target_i)`` (the :class:`_SharedLogitsLogprob` rule), then the hidden / weight / bias gradients as
    :class:`_ChunkedLinearLogprob` (:func:`_linear_backward`). Outputs are matched to chunks by masks over ``[N]``
    (no host sync), ``O(N)`` work per chunk beside the chunk's ``O(c V H)``."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, index, targets, temperature, calculate_entropy, chunk, op):
        lses, ss, z_t = [], [], None
        for a, b in _chunks(hidden.shape[0], chunk):
            z = F.linear(hidden[a:b], weight, bias)  # [c, V]
            _, _, lse_c, s_c = _chunked_stats(z, None, temperature, calculate_entropy, _lean_chunk(b - a, b - a), op)
            sel = (index >= a) & (index < b)  # the outputs reading this chunk's rows
            z_c = _scaled(z[torch.where(sel, index - a, 0), targets], temperature, op)  # [N]
            z_t = torch.where(sel, z_c, 0 if z_t is None else z_t)
            lses.append(lse_c)
            ss.append(s_c)
        if z_t is None:  # no rows (and so no outputs)
            lse = hidden.new_empty(0, dtype=_softmax_dtype(hidden.dtype))
            z_t, s = lse, (lse if calculate_entropy else None)
        else:
            lse, s = torch.cat(lses), (torch.cat(ss) if calculate_entropy else None)
        logp, ent = _shared_outputs(z_t, index, lse, s)
        return _linear_forward_done(ctx, (hidden, weight, bias, index, targets, lse, s), temperature, chunk, op,
                                    logp, ent, calculate_entropy)

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, bias, index, targets, lse, s = ctx.saved_tensors
        g_row, g_ent_row = _row_grads(index, lse, s, g_lp, g_ent)

        def block_grad(z, a, b):
            return _chunk_grad(z, targets, ctx.temperature, lse[a:b], None if s is None else s[a:b],
                               None if g_row is None else g_row[a:b], None if g_ent_row is None else g_ent_row[a:b],
                               owned=True, pairs=_chunk_pairs(index, targets, g_lp, lse.dtype, a, b), op=ctx.op)

        return (*_linear_backward(ctx, hidden, weight, bias, block_grad), None, None, None, None, None, None)


def linear_head_params(module) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(weight [V, H], bias [V] | None)`` of an LM head whose forward is ``torch.nn.Linear``'s (also when FSDP2
    wraps it: its class then derives from ``nn.Linear`` without a forward of its own); ``ValueError`` otherwise."""
    if not isinstance(module, torch.nn.Linear) or type(module).forward is not torch.nn.Linear.forward:
        name = f"{type(module).__module__}.{type(module).__qualname__}"
        raise ValueError(f"lm_head: logits_optimization='memory' computes the head as F.linear(hidden, weight, bias) "
                         f"from its parameters and never calls the module; expected a torch.nn.Linear head (with "
                         f"nn.Linear's forward), got {name}, whose forward would be skipped (a PEFT LoRA layer on the "
                         "head, for one, adds its low-rank update there). Use logits_optimization='none' or 'compute' "
                         "(they call the head), or leave the head out of the adapter's target_modules.")
    return module.weight, module.bias


def linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor,
                    *, temperature: float = 1.0, calculate_entropy: bool = False, chunk_size: int = DEFAULT_CHUNK,
                    index: Optional[torch.Tensor] = None,
                    temperature_op: str = "upcast") -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The ``memory`` mode: log-probs (and entropy) of ``targets`` under ``F.linear(hidden, weight, bias) /
    temperature``, one ``[chunk_size, V]`` block of logits at a time, recomputed in backward.

    Args:
        hidden: ``[N, H]`` hidden states at response-predicting rows (any float dtype); with ``index``, ``[Nh, H]``
            one row per distinct position.
        weight: ``[V, H]`` head weight; bias: ``[V]`` or None (gradients flow to both through autograd).
        targets: ``[N] int64``; temperature: a float > 0; chunk_size: rows of ``hidden`` per chunk.
        index: ``[N] int64`` or None: output ``i`` reads row ``index[i]`` of ``hidden`` (a prefix tree's shared
            tokens: the head runs once per row, :class:`_SharedLinearLogprob`).
        temperature_op: where the temperature divides each chunk's logits (:data:`TEMPERATURE_OPS`, module doc).

    Returns:
        ``(log_probs [N], entropy [N] or None)`` in fp32 (fp64 for fp64 logits).
    """
    temperature = _check_call(temperature, chunk_size)
    op = check_temperature_op(temperature_op)
    if index is not None:
        logp, ent = _SharedLinearLogprob.apply(hidden, weight, bias, index, targets, temperature, calculate_entropy,
                                               chunk_size, op)
    else:
        logp, ent = _ChunkedLinearLogprob.apply(hidden, weight, bias, targets, temperature, calculate_entropy,
                                                chunk_size, op)
    return logp, (ent if calculate_entropy else None)


def _check_call(temperature, chunk_size) -> float:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature: expected a float > 0, got {temperature!r}.")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size: expected an int >= 1, got {chunk_size!r}.")
    return float(temperature)


def logits_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                    calculate_entropy: bool = False, logits_optimization: str = "none",
                    chunk_size: int = DEFAULT_CHUNK, index: Optional[torch.Tensor] = None,
                    temperature_op: str = "upcast") -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs (and entropy) from already materialised ``logits [N, V]`` (modes ``none`` and ``compute``; the
    ``memory`` mode never materialises them: use :func:`response_logprobs`). ``targets [N] int64``.
    ``index [N] int64``: the logits are ``[Nh, V]``, one row per distinct position, and output ``i`` reads row
    ``index[i]`` (a prefix tree's shared tokens: the softmax statistics run once per row). Row blocks (both modes):
    at most ``chunk_size`` and at most ``ceil(rows / LEAN_BLOCKS)`` rows (:func:`_lean_chunk`).
    ``temperature_op``: where the temperature divides (:data:`TEMPERATURE_OPS`, module doc).
    Returns ``(log_probs [N], entropy [N] or None)`` in fp32 (fp64 for fp64 logits)."""
    mode = check_logits_optimization(logits_optimization)
    temperature = _check_call(temperature, chunk_size)
    op = check_temperature_op(temperature_op)
    if mode == "memory":
        raise ValueError("logits_optimization: 'memory' never materialises the logits; call response_logprobs with "
                         "the hidden states and the lm_head module.")
    chunk = _lean_chunk(logits.shape[0], chunk_size)
    if index is not None:
        logp, ent = _SharedLogitsLogprob.apply(logits, index, targets, temperature, calculate_entropy, chunk, op)
        return logp, (ent if calculate_entropy else None)
    logp, ent = _LogitsLogprob.apply(logits, targets, temperature, calculate_entropy, chunk, op)
    return logp, (ent if calculate_entropy else None)


def response_logprobs(hidden: torch.Tensor, lm_head: torch.nn.Module, targets: torch.Tensor, *,
                      temperature: float = 1.0, calculate_entropy: bool = False, logits_optimization: str = "none",
                      chunk_size: int = DEFAULT_CHUNK,
                      temperature_op: str = "upcast") -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs (and entropy) of ``targets`` under ``lm_head(hidden) / temperature``.

    Args:
        hidden: ``[N, H]`` hidden states at response-predicting rows (any float dtype).
        lm_head: the output-embedding module (``model.get_output_embeddings()``), ``[.., H] -> [.., V]``; called
            once in modes ``none`` / ``compute``; in ``memory`` a ``torch.nn.Linear`` whose weight / bias are used
            directly (:func:`linear_head_params`), never called.
        targets: ``[N] int64`` predicted token ids.
        temperature: divides the logits; > 0.
        calculate_entropy: also return the entropy ``[N]``.
        logits_optimization: ``none | compute | memory`` (see module doc).
        chunk_size: rows per chunk of ``memory``; the most rows per block of ``none`` / ``compute``.
        temperature_op: where the temperature divides the logits (:data:`TEMPERATURE_OPS`, module doc).

    Returns:
        ``(log_probs [N], entropy [N] or None)`` in fp32 (fp64 if ``hidden`` is fp64).
    """
    mode = check_logits_optimization(logits_optimization)
    temperature = _check_call(temperature, chunk_size)
    if mode != "memory":
        return logits_logprobs(lm_head(hidden), targets, temperature=temperature,
                               calculate_entropy=calculate_entropy, logits_optimization=mode, chunk_size=chunk_size,
                               temperature_op=temperature_op)
    weight, bias = linear_head_params(lm_head)
    return linear_logprobs(hidden, weight, bias, targets, temperature=temperature,
                           calculate_entropy=calculate_entropy, chunk_size=chunk_size, temperature_op=temperature_op)
