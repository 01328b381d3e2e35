"""The one model step of zorro: run a model on a plan and return response log-probs / entropy (docs/DESIGN.md §4).

Every caller — the standalone API (``DeduplicatedActor``), the verl 0.9 engine, the verl 0.7 actor, the demo and the
benchmark — runs the deduplicated forward through :func:`zorro_step`, so a new capability is added here once.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from zorro_verl.integrations.transformers.context import LayerCalls, StepContext
from zorro_verl.integrations.transformers.install import forward_packed
from zorro_verl.logprob import DEFAULT_CHUNK, check_logits_optimization, logits_logprobs, response_logprobs
from zorro_verl.packing import ZorroPlan

__all__ = ["zorro_step"]


def _per_row_temperature(temperature: torch.Tensor, plan: ZorroPlan, memory: bool):
    """A per-row temperature tensor ``[B]`` (or ``[B, 1]``) -> ``(float, None)`` when no division is needed (all
    ones) or the ``memory`` mode takes one float, else ``(1.0, divisors [N] float32)``; one host sync."""
    t = temperature.reshape(-1).to(torch.float32)
    if t.numel() != plan.B:
        raise ValueError(f"temperature: expected a float or a tensor with one value per row ({plan.B}), got shape "
                         f"{tuple(temperature.shape)}.")
    uniform, ones, first = torch.stack([(t == t[0]).all(), (t == 1).all(), t[0]]).tolist()
    if memory:
        if not uniform:
            raise ValueError("temperature: per-row temperatures with logits_optimization='memory' are not "
                             "supported (the chunked head takes one temperature); use 'none' or 'compute'.")
        return first, None
    return 1.0, (None if ones else t[plan.out_row])


def zorro_step(model, plan: ZorroPlan, *, backend: str = "sdpa",
               temperature: Union[float, torch.Tensor] = 1.0, calculate_entropy: bool = False,
               logits_optimization: str = "none", chunk_size: int = DEFAULT_CHUNK,
               calls: Optional[LayerCalls] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Deduplicated forward of ``plan``: log-probs (and entropy) of every valid response token, original row order.

    Args:
        model: the root ``*ForCausalLM`` (possibly FSDP-wrapped) with zorro installed
            (:func:`~zorro_verl.integrations.transformers.install_zorro`).
        plan: the micro-batch's plan (:func:`~zorro_verl.packing.build_plan`).
        backend: a registered attention backend name (:data:`~zorro_verl.attention.BACKEND_NAMES`).
        temperature: a float > 0 (divides the logits after their fp32 upcast), or a per-row tensor ``[B]`` as
            verl passes per-sample temperatures (divides the logits in their own dtype, as verl does; the memory
            mode needs them all equal).
        calculate_entropy: also compute the entropy.
        logits_optimization: ``none | compute | memory`` (:mod:`zorro_verl.logprob`).
        chunk_size: rows per chunk of the ``compute`` / ``memory`` modes.
        calls: an optional :class:`LayerCalls` that receives this forward's layer counts (e.g. fallback kernels).

    Returns:
        ``(log_probs [N], entropy [N] | None)`` — fp32 (fp64 for fp64 models); ``plan.to_padded`` gives ``[B, R]``.
    """
    mode = check_logits_optimization(logits_optimization)
    ctx = StepContext(plan, backend, calls)
    divisors = None
    if isinstance(temperature, torch.Tensor):
        temperature, divisors = _per_row_temperature(temperature, plan, memory=mode == "memory")
    head = model.get_output_embeddings()
    if mode == "memory":
        # The root forward runs as usual (FSDP hooks, final norm) with the head fed an empty slice; a pre-hook keeps
        # the head's input, the [N, H] response-predicting hidden states, for the chunked log-prob Function.
        kept = {}

        def keep_input(module, args):
            kept["h"] = args[0]
            return (args[0][:, :0],) + tuple(args[1:])

        handle = head.register_forward_pre_hook(keep_input)
        try:
            forward_packed(model, ctx, logits_to_keep=plan.logit_index)
        finally:
            handle.remove()
        return response_logprobs(kept["h"][0], head, plan.target_ids, temperature=temperature,
                                 calculate_entropy=calculate_entropy, logits_optimization=mode, chunk_size=chunk_size)
    logits = forward_packed(model, ctx, logits_to_keep=plan.logit_index).logits[0]  # [N, V]
    if divisors is not None:  # same op and dtype as verl's per-sample temperature scaling
        logits = logits / divisors.clamp(min=1e-8).to(logits.dtype)[:, None]
    return logits_logprobs(logits, plan.target_ids, temperature=temperature, calculate_entropy=calculate_entropy,
                           logits_optimization=mode, chunk_size=chunk_size)
