"""Response-only log-probs and entropy from hidden states at response-predicting rows (docs/DESIGN.md §3).
Imports torch only.

``logits_optimization`` (the one name of this knob in the API, the verl config and here):

* ``none``    — materialize ``[N, V]`` logits once, then log-softmax / entropy (the reference);
* ``compute`` — materialize logits once, run the softmax / entropy follow-up in row chunks;
* ``memory``  — an autograd Function that never holds more than one ``[chunk, V]`` block of logits: forward under
  no_grad per chunk, backward recomputes each chunk and back-propagates through the ``lm_head`` module.

Logits are computed in the hidden dtype and the softmax in at least fp32 (fp64 stays fp64).
Entropy is ``lse - sum(softmax * logits)``. The ``lm_head`` *module* is called (FSDP2 hooks), never its weight.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["LOGITS_MODES", "DEFAULT_CHUNK", "check_logits_optimization", "response_logprobs", "logits_logprobs",
           "logprobs_from_logits", "logprobs_from_logits_chunked"]

#: Values of ``logits_optimization``.
LOGITS_MODES = ("none", "compute", "memory")
#: Rows per chunk of the ``compute`` and ``memory`` modes: ``[1024, V]`` fp32 is 0.6 GB at Qwen3's V = 151,936.
DEFAULT_CHUNK = 1024


def check_logits_optimization(value) -> str:
    """``value`` if it is one of :data:`LOGITS_MODES`, else a ``ValueError`` naming the choices."""
    if value not in LOGITS_MODES:
        raise ValueError(f"logits_optimization: expected one of {LOGITS_MODES}, got {value!r}.")
    return value


def _softmax_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                         calculate_entropy: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``logits [n, V]``, ``targets [n] int64`` -> ``(log_probs [n], entropy [n] | None)`` in fp32 (fp64 for fp64)."""
    logits = logits.to(_softmax_dtype(logits.dtype))
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)  # [n]
    logp = logits.gather(-1, targets[:, None]).squeeze(-1) - lse
    ent = None
    if calculate_entropy:
        ent = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return logp, ent


def logprobs_from_logits_chunked(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                                 calculate_entropy: bool, chunk_size: int = DEFAULT_CHUNK
                                 ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """:func:`logprobs_from_logits` over row chunks of already materialized ``logits [n, V]`` (the ``compute``
    mode): the fp32 softmax / entropy intermediates exist for one chunk at a time."""
    if logits.shape[0] <= chunk_size:
        return logprobs_from_logits(logits, targets, temperature, calculate_entropy)
    parts = [logprobs_from_logits(logits[s:s + chunk_size], targets[s:s + chunk_size], temperature,
                                  calculate_entropy) for s in range(0, logits.shape[0], chunk_size)]
    return torch.cat([a for a, _ in parts]), (torch.cat([b for _, b in parts]) if calculate_entropy else None)


class _ChunkedLogprob(torch.autograd.Function):
    """Memory mode: ``hidden [N, H] -> (log_probs [N], entropy [N])`` holding one ``[chunk, V]`` at a time."""

    @staticmethod
    def forward(ctx, hidden, lm_head, targets, temperature, calculate_entropy, chunk):
        n = hidden.shape[0]
        out_dtype = _softmax_dtype(hidden.dtype)
        logp = hidden.new_empty(n, dtype=out_dtype)
        ent = hidden.new_zeros(n, dtype=out_dtype)
        with torch.no_grad():
            for s in range(0, n, chunk):
                lp, en = logprobs_from_logits(lm_head(hidden[s:s + chunk]), targets[s:s + chunk], temperature,
                                              calculate_entropy)
                logp[s:s + chunk] = lp
                if en is not None:
                    ent[s:s + chunk] = en
        ctx.save_for_backward(hidden, targets)
        ctx.lm_head, ctx.temperature, ctx.calculate_entropy, ctx.chunk = lm_head, temperature, calculate_entropy, chunk
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        hidden, targets = ctx.saved_tensors
        grad_hidden = torch.zeros_like(hidden)
        chunk = ctx.chunk
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s:s + chunk].detach().requires_grad_(True)
            with torch.enable_grad():
                lp, en = logprobs_from_logits(ctx.lm_head(h), targets[s:s + chunk], ctx.temperature,
                                              ctx.calculate_entropy)
                outs, grads = [lp], [grad_logp[s:s + chunk]]
                if en is not None and grad_ent is not None:
                    outs.append(en)
                    grads.append(grad_ent[s:s + chunk])
                # Accumulates lm_head parameter grads directly (as activation checkpointing does) and gives dh.
                torch.autograd.backward(outs, grads, inputs=[h, *[p for p in ctx.lm_head.parameters()
                                                                  if p.requires_grad]])
            grad_hidden[s:s + chunk] = h.grad
        return grad_hidden, None, None, None, None, None


def _check_call(temperature, chunk_size) -> float:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature: expected a float > 0, got {temperature!r}.")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size: expected an int >= 1, got {chunk_size!r}.")
    return float(temperature)


def logits_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                    calculate_entropy: bool = False, logits_optimization: str = "none",
                    chunk_size: int = DEFAULT_CHUNK) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs (and entropy) from already materialised ``logits [N, V]`` (modes ``none`` and ``compute``; the
    ``memory`` mode never materialises them: use :func:`response_logprobs`). ``targets [N] int64``.
    Returns ``(log_probs [N], entropy [N] or None)`` in fp32 (fp64 for fp64 logits)."""
    mode = check_logits_optimization(logits_optimization)
    temperature = _check_call(temperature, chunk_size)
    if mode == "memory":
        raise ValueError("logits_optimization: 'memory' never materialises the logits; call response_logprobs with "
                         "the hidden states and the lm_head module.")
    if mode == "compute":
        return logprobs_from_logits_chunked(logits, targets, temperature, calculate_entropy, chunk_size)
    return logprobs_from_logits(logits, targets, temperature, calculate_entropy)


def response_logprobs(hidden: torch.Tensor, lm_head: torch.nn.Module, targets: torch.Tensor, *,
                      temperature: float = 1.0, calculate_entropy: bool = False, logits_optimization: str = "none",
                      chunk_size: int = DEFAULT_CHUNK) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs (and entropy) of ``targets`` under ``lm_head(hidden) / temperature``.

    Args:
        hidden: ``[N, H]`` hidden states at response-predicting rows (any float dtype).
        lm_head: the output-embedding module (``model.get_output_embeddings()``), ``[.., H] -> [.., V]``.
        targets: ``[N] int64`` predicted token ids.
        temperature: divides the logits; > 0.
        calculate_entropy: also return the entropy ``[N]``.
        logits_optimization: ``none | compute | memory`` (see module doc).
        chunk_size: rows per chunk for ``compute`` / ``memory``.

    Returns:
        ``(log_probs [N], entropy [N] or None)`` in fp32 (fp64 if ``hidden`` is fp64).
    """
    mode = check_logits_optimization(logits_optimization)
    temperature = _check_call(temperature, chunk_size)
    if mode != "memory" or hidden.shape[0] == 0:
        return logits_logprobs(lm_head(hidden), targets, temperature=temperature,
                               calculate_entropy=calculate_entropy,
                               logits_optimization="none" if mode == "memory" else mode, chunk_size=chunk_size)
    logp, ent = _ChunkedLogprob.apply(hidden, lm_head, targets, temperature, calculate_entropy, chunk_size)
    return logp, (ent if calculate_entropy else None)
