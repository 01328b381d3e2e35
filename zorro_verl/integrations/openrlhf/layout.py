"""OpenRLHF's batch layout -> zorro's plan, and the plan's results -> OpenRLHF's return layout
(docs/design/openrlhf.md).

OpenRLHF 0.11 (``Experience``, ``Actor.forward``) keeps each sample as one contiguous span of valid tokens
``[prompt | response]`` inside a padded row (right padded after ``make_experience_batch``), and marks the tokens
to train on with ``action_mask [B, A]``, aligned to the *last* ``A`` positions of the shifted log-probs: action
column ``j`` is the log-prob of token ``T - A + j`` (0.11.2 uses ``A = T - 1``, every position)::

    sequences  [B, T]:  [ p0 p1 p2 | x0 x1 x2 . . ]      (. = pad, attention_mask 0)
    action_mask[B, A]:       0  0  1  1  1  0 0         (A = T - 1: column j is token j + 1)

Here a sample's *prompt* is its valid tokens before its first action token and its *response* runs from the first
to the last action token; tokens between actions (tool observations) are response context with mask 0, tokens
after the last action are dropped (nothing of OpenRLHF's output reads them: the forward is causal and they have no
action). A sample without any action token keeps only its first token (its log-probs are all masked to 0). That is
the verl layout :func:`~zorro_verl.packing.build_plan` reads (left-padded prompts, right-padded responses), built
by one gather.

Imports torch and the core only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zorro_verl.packing import ZorroPlan, build_plan

__all__ = ["OpenRLHFLayout", "SampleSpans", "sample_spans", "plan_from_openrlhf", "verl_layout",
           "scatter_actions", "scatter_entropy", "OUTPUT_DTYPE"]

# OpenRLHF's Actor.forward casts the logits to fp32 before its log-softmax and entropy, whatever the model's dtype:
# its log-probs and entropies are fp32, and so are the ones zorro hands back. (The fp64 run-level tests set this and
# OpenRLHF's cast to fp64 together, on both sides.)
OUTPUT_DTYPE = torch.float32


@dataclass
class SampleSpans:
    """Per row (all ``[B] int64`` / bool, no host sync): ``start`` of the valid span, ``length`` of it,
    ``first_action`` (sequence position of the first response token), ``p`` prompt and ``r`` response lengths
    (``r = 0`` without an action token), and the violations ``bad_span`` (valid tokens not contiguous),
    ``bad_action`` (an action outside the span or at its first token), ``empty`` (no valid token)."""

    start: torch.Tensor
    length: torch.Tensor
    first_action: torch.Tensor
    p: torch.Tensor
    r: torch.Tensor
    bad_span: torch.Tensor
    bad_action: torch.Tensor
    empty: torch.Tensor


def sample_spans(attention_mask: torch.Tensor, action_mask: torch.Tensor) -> SampleSpans:
    """Where each row's prompt and response lie (the module docstring's rule), vectorised, no host sync.

    Args:
        attention_mask: ``[B, T]`` 0/1; action_mask: ``[B, A]`` 0/1 with ``A <= T - 1`` (column ``j`` = token
        ``T - A + j``).
    """
    B, T = attention_mask.shape
    A = action_mask.shape[1]
    dev = attention_mask.device
    am = attention_mask != 0  # [B, T]
    act = action_mask != 0  # [B, A]
    ar_t = torch.arange(T, device=dev)
    length = am.sum(1)  # [B] valid tokens
    start = am.int().argmax(1)  # [B] first valid position
    in_span = (ar_t[None] >= start[:, None]) & (ar_t[None] < (start + length)[:, None])
    off = T - A
    has = act.any(1)
    j0 = act.int().argmax(1)
    j1 = A - 1 - act.flip(1).int().argmax(1)
    a0 = torch.where(has, off + j0, start + 1)  # [B] first response token (no action: past the first token)
    a1 = torch.where(has, off + j1, start)  # [B] last response token (no action: none)
    p = a0 - start
    return SampleSpans(start=start, length=length, first_action=a0, p=p, r=a1 - a0 + 1,
                       bad_span=(in_span != am).any(1), bad_action=has & ((p < 1) | (a1 >= start + length)),
                       empty=length == 0)


@dataclass
class OpenRLHFLayout:
    """A plan plus what maps its results back to OpenRLHF's tensors.

    ``plan``: the micro-batch's :class:`~zorro_verl.packing.ZorroPlan`; ``first_action [B] int64``: the sequence
    position of each row's first response token; ``T`` and ``A``: OpenRLHF's widths; ``stock_tokens``: valid tokens
    of the ordinary forward (``attention_mask.sum()``).
    """

    plan: ZorroPlan
    first_action: torch.Tensor
    T: int
    A: int
    stock_tokens: int

    def token_positions(self) -> torch.Tensor:
        """``[N] int64``: the sequence position of every valid response token of the plan (original row order)."""
        return self.first_action[self.plan.out_row] + self.plan.out_col


def _check(name: str, t, ndim: int) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != ndim:
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got {got}.")


def plan_from_openrlhf(sequences: torch.Tensor, attention_mask: torch.Tensor,
                       action_mask: torch.Tensor) -> OpenRLHFLayout:
    """Build the deduplicated plan of an OpenRLHF micro-batch (arguments as in :func:`verl_layout`).

    Returns:
        An :class:`OpenRLHFLayout`. One host sync in :func:`verl_layout` plus :func:`build_plan`'s two.
    """
    ids, valid, R, sp, stock = verl_layout(sequences, attention_mask, action_mask)
    plan = build_plan(ids, valid, R)
    return OpenRLHFLayout(plan=plan, first_action=sp.first_action, T=sequences.shape[1], A=action_mask.shape[1],
                          stock_tokens=stock)


def verl_layout(sequences: torch.Tensor, attention_mask: torch.Tensor, action_mask: torch.Tensor):
    """An OpenRLHF micro-batch in verl's layout (left-padded prompts, right-padded responses), checked.

    Args:
        sequences: ``[B, T] int64`` — prompt + response token ids, one contiguous valid span per row.
        attention_mask: ``[B, T]`` 0/1 — 1 on the valid span.
        action_mask: ``[B, A]`` 0/1 (bool or int), ``1 <= A <= T - 1`` — column ``j`` marks token ``T - A + j``.

    Returns:
        ``(input_ids [B, Pw + R] int64, valid [B, Pw + R] bool, R, spans, stock_tokens)``: what
        :func:`build_plan` reads, the :class:`SampleSpans` and the valid tokens of the ordinary forward. One host
        sync (the checks and the widths).

    Raises:
        ValueError naming the field when a row's valid tokens are not one contiguous span, a row is empty, an
        action token lies outside the valid span or is the row's first token.
    """
    _check("sequences", sequences, 2)
    _check("attention_mask", attention_mask, 2)
    _check("action_mask", action_mask, 2)
    B, T = sequences.shape
    A = action_mask.shape[1]
    if attention_mask.shape != (B, T) or action_mask.shape[0] != B or not 1 <= A <= T - 1:
        raise ValueError(f"attention_mask / action_mask: expected [B, T] = {(B, T)} and [B, A] with 1 <= A <= T-1, "
                         f"got {tuple(attention_mask.shape)} and {tuple(action_mask.shape)}.")
    sp = sample_spans(attention_mask, action_mask)
    n_span, n_act, n_empty, Pw, R, stock = torch.stack([
        sp.bad_span.sum(), sp.bad_action.sum(), sp.empty.sum(), sp.p.max(), sp.r.max(), sp.length.sum()]).tolist()
    if n_empty:
        raise ValueError(f"attention_mask: {n_empty} row(s) have no valid token; every OpenRLHF sample holds at least "
                         "its prompt. Drop empty rows before the forward.")
    if n_span:
        raise ValueError(f"attention_mask: {n_span} row(s) have valid tokens that are not one contiguous span "
                         "(padding inside a sample); zorro expects OpenRLHF's layout of one [prompt | response] span "
                         "per row. Remove the inner padding.")
    if n_act:
        raise ValueError(f"action_mask: {n_act} row(s) mark an action on a padding token or on the sample's first "
                         "token; an action column j must mark a valid token T - A + j after the prompt's first token.")
    start, a0, p, r = sp.start, sp.first_action, sp.p, sp.r
    S = Pw + R
    col = torch.arange(S, device=sequences.device)[None]  # [1, S]
    k = col - (Pw - p[:, None])  # prompt index of a prompt column
    j = col - Pw  # response index of a response column
    valid = torch.where(col < Pw, k >= 0, j < r[:, None])  # [B, S]
    src = torch.where(col < Pw, start[:, None] + k, a0[:, None] + j).clamp(0, T - 1)  # [B, S] sequence position
    ids = torch.where(valid, sequences.long().gather(1, src), 0)
    return ids, valid, R, sp, stock


def scatter_actions(layout: OpenRLHFLayout, values: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """Per-response-token values ``[N]`` -> OpenRLHF's action log-probs ``[B, A]`` fp32 (:data:`OUTPUT_DTYPE`), times
    ``action_mask`` (as ``Actor.forward`` returns them). Differentiable in ``values``."""
    plan = layout.plan
    cols = layout.token_positions() - (layout.T - layout.A)
    out = values.new_zeros(plan.B, layout.A, dtype=OUTPUT_DTYPE)
    return out.index_put((plan.out_row, cols), values.to(OUTPUT_DTYPE)) * action_mask.float()


def scatter_entropy(layout: OpenRLHFLayout, values: torch.Tensor) -> torch.Tensor:
    """Per-response-token entropies ``[N]`` -> ``[B, T - 1]`` fp32 at the positions that predict each response
    token (OpenRLHF's ``output.entropy`` layout); 0 elsewhere (prompt positions, pads, the dropped tail), which
    OpenRLHF never reads (its entropy loss is masked by ``action_mask``)."""
    plan = layout.plan
    out = values.new_zeros(plan.B, layout.T - 1, dtype=OUTPUT_DTYPE)
    return out.index_put((plan.out_row, layout.token_positions() - 1), values.to(OUTPUT_DTYPE))
