"""CPU stand-ins for the two GPU kernels verl's stock engine runs on a GPU, so that the e2e benchmark
(tests/e2e/bench.py) measures stock as it costs where users train, not CPU artefacts of stock.

1. ``attn_implementation="cpu_varlen"`` for flash-attn's varlen attention kernel.

verl's stock engine packs a micro-batch's rows into one sequence (``input_ids [1, T]``, ``position_ids`` restarting
at 0 for each row). On a GPU, flash-attn's varlen kernel computes each row's causal attention alone. With ``sdpa``
on a CPU, transformers detects the packing and builds a ``[1, 1, T, T]`` block-diagonal mask, and the kernel then
computes all ``T^2`` (query, key) pairs of the micro-batch, most of them masked: at ``T = 8192`` that is ~30x the
pairs flash computes. A benchmark against that would credit zorro with a CPU artefact of stock. This implementation
computes what flash varlen computes: per row (segment of ``position_ids``), causal ``scaled_dot_product_attention``.

Only remove-padding forwards: a padded batch (an attention mask) is refused, never approximated.
:func:`flash_varlen_kernel` is the same computation in the form verl's Ulysses attention calls flash-attn through
(transformers' ``_flash_attention_forward``, ``[1, T, H, D]`` tensors after the all-to-all), for the stock SP engine
of the long-context benchmark (``zorro_verl/bench/long_verl.py``).

2. :func:`blocked_logprobs` for flash-attn's cross-entropy kernel. Without flash-attn, verl's
``logprobs_from_logits`` falls back to ``logprobs_from_logits_v2``, which loops in Python over every token of the
packed micro-batch (one ``log_softmax`` per token in bf16: ~0.3 s forward + 0.3 s backward for 13K tokens here,
~20x a blocked computation). :func:`blocked_logprobs` computes the same log-probs, in fp32 like flash's kernel,
``BLOCK`` rows at a time (peak memory of one block's fp32 log-softmax). zorro's engine does not call verl's function
(its own log-prob path is row-blocked), so the stand-in changes only stock.
"""

from __future__ import annotations

import torch

__all__ = ["NAME", "BLOCK", "cpu_varlen_attention", "flash_varlen_kernel", "register", "blocked_logprobs",
           "use_blocked_logprobs"]

NAME = "cpu_varlen"


def _segments(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    """``[(start, end)]`` of the packed rows of ``position_ids [1, T] int64`` (a row starts where the position does
    not continue the previous one)."""
    pos = position_ids[0]
    starts = torch.nonzero(torch.cat([torch.ones(1, dtype=torch.bool, device=pos.device),
                                      pos[1:] != pos[:-1] + 1])).flatten().tolist()
    ends = starts[1:] + [pos.numel()]
    return list(zip(starts, ends))


def cpu_varlen_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                         dropout: float = 0.0, scaling=None, is_causal=None, **kwargs):
    """transformers attention function. ``query [1, Hq, T, D]``, ``key``/``value [1, Hkv, T, D]`` (any float dtype),
    ``position_ids [1, T] int64`` in ``kwargs`` -> ``([1, T, Hq, D], None)``: causal attention within each packed
    row."""
    position_ids = kwargs.get("position_ids")
    if attention_mask is not None or position_ids is None or query.shape[0] != 1:
        raise ValueError(f"attn_implementation={NAME!r}: expected a remove-padding forward (batch 1, position_ids, no "
                         f"attention mask), got batch {query.shape[0]}, attention_mask "
                         f"{None if attention_mask is None else tuple(attention_mask.shape)}, position_ids "
                         f"{None if position_ids is None else tuple(position_ids.shape)}. Use sdpa for padded "
                         "batches.")
    out = torch.empty_like(query)
    gqa = query.shape[1] != key.shape[1]
    for s, e in _segments(position_ids):
        out[:, :, s:e] = torch.nn.functional.scaled_dot_product_attention(
            query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], is_causal=True, scale=scaling,
            dropout_p=dropout if module.training else 0.0, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None


def flash_varlen_kernel(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, query_length,
                        *args, position_ids=None, is_causal=True, softmax_scale=None, **kwargs) -> torch.Tensor:
    """transformers' ``_flash_attention_forward`` as flash-attn's varlen kernel computes it, on CPU: ``query
    [1, T, Hq, D]``, ``key``/``value [1, T, Hkv, D]``, ``position_ids [1, T] int64`` (rows start where the position
    does not continue) -> ``[1, T, Hq, D]``, causal attention within each row (``is_causal=False``: bidirectional)."""
    if attention_mask is not None or position_ids is None or query.shape[0] != 1:
        raise ValueError(f"flash_varlen_kernel: expected a remove-padding forward (batch 1, position_ids, no "
                         f"attention mask), got batch {query.shape[0]}, attention_mask "
                         f"{None if attention_mask is None else tuple(attention_mask.shape)}, position_ids "
                         f"{None if position_ids is None else tuple(position_ids.shape)}.")
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # [1, H, T, D]
    out = torch.empty_like(q)
    gqa = q.shape[1] != k.shape[1]
    for s, e in _segments(position_ids):
        out[:, :, s:e] = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=is_causal, scale=softmax_scale, enable_gqa=gqa)
    return out.transpose(1, 2)


def register() -> None:
    """Register :data:`NAME` with transformers (attention function; flash's mask function: no mask for packed rows)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    AttentionInterface.register(NAME, cpu_varlen_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, flash_attention_mask)


#: rows of logits per block of :func:`blocked_logprobs`
BLOCK = 2048


def blocked_logprobs(logits: torch.Tensor, labels: torch.Tensor, inplace_backward: bool = True) -> torch.Tensor:
    """``logits [..., V]`` (any float dtype), ``labels [...] int64`` -> ``[...] float32`` log-probabilities of the
    labels, ``BLOCK`` rows at a time (``inplace_backward`` is accepted for verl's signature and ignored)."""
    shape = logits.shape[:-1]
    flat, lab = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    out = [torch.log_softmax(b.float(), dim=-1).gather(-1, lb.unsqueeze(-1)).squeeze(-1)
           for b, lb in zip(flat.split(BLOCK), lab.split(BLOCK))]
    return (torch.cat(out) if out else flat.new_zeros(0, dtype=torch.float32)).view(shape)


def use_blocked_logprobs(module) -> None:
    """Post-import hook of ``verl.workers.engine.fsdp.transformer_impl``: its ``logprobs_from_logits`` becomes
    :func:`blocked_logprobs`."""
    module.logprobs_from_logits = blocked_logprobs
