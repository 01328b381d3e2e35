"""The per-micro-batch plan: every index tensor the deduplicated forward needs, built once.

Legend used in every docstring of the package:

* ``B``  rows of the micro-batch (prompt + response samples)
* ``G``  unique prompts (groups) in the micro-batch
* ``S``  padded row width ``Pw + R`` of the verl batch
* ``Pw`` padded prompt width (left padded), ``R`` padded response width (right padded)
* ``P``  a prompt's valid length, ``Pmax`` the largest one; ``r`` a response's valid length, ``Rmax`` the largest
* ``T``  tokens of the packed dedup row: ``sum_g P_g + sum_b r_b``
* ``N``  response-predicting rows = valid response tokens: ``sum_b r_b``
* ``Hq``/``Hkv`` query / key-value heads, ``D`` head dim, ``V`` vocabulary

Packed layout (one row, groups in order of first appearance, responses of a group in row order)::

    row:   [ P0 | R(b=0) | R(b=3) | P1 | R(b=1) | R(b=2) ]
    pos:     0..p0-1, p0..p0+r0-1, p0..p0+r3-1, 0..p1-1, ...

A prompt token attends causally within its prompt; a response token attends to its whole prompt and causally to
its own response, never to a sibling. The logit that predicts a response's first token is the one at its
prompt's last token, read once per response (``logit_index``).

This module imports torch only. All host synchronisation of the micro-batch happens in :func:`build_plan`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

__all__ = ["ZorroPlan", "PlanCache", "build_plan", "require_plan", "ATTENTION_BACKENDS"]

#: Names accepted for ``ZorroPlan.backend``.
#: ``sdpa``/``eager``: the reference two-call attention with SDPA or explicit math;
#: ``flash``: flash-attn varlen (GPU); ``flex``: FlexAttention block mask;
#: ``standard``: "standard QKV" mode — K/V expanded to full rows, one ordinary causal call;
#: ``flash_copyfree``: flash varlen without per-response K/V copies (prompt/self parts merged by log-sum-exp).
ATTENTION_BACKENDS = ("sdpa", "eager", "flash", "flex", "standard", "flash_copyfree")


def _excl_cumsum(x: torch.Tensor) -> torch.Tensor:
    """Exclusive prefix sum of a 1-D int64 tensor: ``[a, b, c] -> [0, a, a+b]``."""
    return torch.cumsum(x, 0) - x


def _cu_seqlens(lengths: torch.Tensor) -> torch.Tensor:
    """flash-attn ``cu_seqlens``: ``[n] int64 -> [n+1] int32`` with a leading zero."""
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=lengths.device)
    out[1:] = torch.cumsum(lengths, 0).to(torch.int32)
    return out


def _scatter_valid(T: int, index: torch.Tensor, valid: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``out [T]`` with ``out[index[valid]] = values[valid]`` without boolean indexing (no host sync): invalid
    entries are written to a dummy slot ``T`` that is cut off."""
    out = torch.zeros(T + 1, dtype=values.dtype, device=values.device)
    out.scatter_(0, torch.where(valid, index, T).flatten(), values.flatten())
    return out[:T]


def _segments_to_tokens(starts: torch.Tensor, lengths: torch.Tensor, total: int) -> torch.Tensor:
    """Expand segments into token indices: ``starts [n], lengths [n] -> [total]`` = ``cat(arange(s, s+l))``."""
    if total == 0:
        return torch.zeros(0, dtype=torch.long, device=starts.device)
    seg = torch.repeat_interleave(torch.arange(starts.numel(), device=starts.device), lengths, output_size=total)
    local = torch.arange(total, device=starts.device) - _excl_cumsum(lengths)[seg]
    return starts[seg] + local


class PlanCache:
    """The plan's lazily built index sets and per-forward counters.

    Deliberately *not* a dict: FSDP2 (and other ``tree_map``-style input casts) rebuild dataclasses and dicts
    found in forward kwargs; an opaque holder is passed through by reference, so a plan copied that way still shares
    its built indices and attention-call count with the original.
    """

    __slots__ = ("_data",)

    def __init__(self):
        self._data: dict = {}

    def get(self, key, default=None):
        return self._data.get(key, default)

    def __getitem__(self, key):
        return self._data[key]

    def __setitem__(self, key, value):
        self._data[key] = value

    def __contains__(self, key):
        return key in self._data


@dataclass
class ZorroPlan:
    """Every index of one micro-batch's deduplicated forward. Built by :func:`build_plan`; never mutated after.

    Python ints (no host sync needed downstream): ``B, S, R, G, T, N, max_prompt_len, max_response_len,
    max_row_len, num_prompt_tokens, num_nonempty_responses, ordinary_tokens`` (tokens of the ordinary per-row
    forward, ``sum_b P_b + r_b``), ``kv_total`` (keys of the varlen response call), ``group_counts`` (groups with
    at least one response token, the most response tokens of a group, and the longest / total prompt of such
    groups: the sizes of the copy-free response-to-prompt call).

    Tensors (all on the batch's device, int64 unless noted):

    * ``input_ids [T]``, ``position_ids [T]``: the packed dedup row.
    * ``row_group [B]``: group id of each row; ``group_rep_row [G]``: first row of each group;
      ``group_sizes [G]``; ``prompt_lens [G]``; ``response_lens [B]``; ``row_prompt_lens [B]``.
    * ``prompt_start [G]``: packed offset of each unique prompt; ``response_start [B]``: of each row's response.
    * ``logit_index [N]``: packed rows whose hidden state predicts each valid response token, original row order;
      ``target_ids [N]``: the predicted tokens; ``out_row [N]``, ``out_col [N]``: their place in ``[B, R]``.
    * ``source_index [T]``: flat index into ``[B * S]`` of the verl batch each packed token was read from (a
      prompt token from its group's first row).
    """

    B: int
    S: int
    R: int
    G: int
    T: int
    N: int
    max_prompt_len: int
    max_response_len: int
    max_row_len: int
    num_prompt_tokens: int
    num_nonempty_responses: int
    ordinary_tokens: int
    kv_total: int
    group_counts: tuple
    backend: str
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    row_group: torch.Tensor
    group_rep_row: torch.Tensor
    group_sizes: torch.Tensor
    prompt_lens: torch.Tensor
    response_lens: torch.Tensor
    row_prompt_lens: torch.Tensor
    prompt_start: torch.Tensor
    response_start: torch.Tensor
    logit_index: torch.Tensor
    target_ids: torch.Tensor
    out_row: torch.Tensor
    out_col: torch.Tensor
    source_index: torch.Tensor
    # Backend index sets, built lazily from the tensors above (no host sync: all shapes are Python ints here).
    _cache: PlanCache = field(default_factory=PlanCache, repr=False, compare=False)

    # ------------------------------------------------------------------ derived, host-side (for the API)
    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def groups(self) -> list[list[int]]:
        """Rows of each group, groups in order of first appearance (a host sync; API use only)."""
        rows = self.row_group.tolist()
        out: list[list[int]] = [[] for _ in range(self.G)]
        for b, g in enumerate(rows):
            out[g].append(b)
        return out

    # ------------------------------------------------------------------ output helpers
    def to_padded(self, values: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """Scatter per-response-token values ``[N, ...]`` into verl's layout ``[B, R, ...]`` (``fill`` on pads)."""
        out = values.new_full((self.B, self.R, *values.shape[1:]), fill)
        return out.index_put((self.out_row, self.out_col), values)

    def from_padded(self, padded: torch.Tensor) -> torch.Tensor:
        """Gather ``[B, R, ...]`` at the valid response tokens -> ``[N, ...]`` (original row order)."""
        return padded[self.out_row, self.out_col]

    def full_index(self) -> torch.Tensor:
        """``[B, S]``: the packed position each token of the verl batch maps to (-1 on pads)."""

        def build():
            dev = self.device
            Pw = self.S - self.R
            ar = torch.arange(self.S, device=dev)[None, :]
            p = self.row_prompt_lens[:, None]
            r = self.response_lens[:, None]
            in_prompt = (ar >= Pw - p) & (ar < Pw)
            in_resp = (ar >= Pw) & (ar < Pw + r)
            pidx = self.prompt_start[self.row_group][:, None] + ar - (Pw - p)
            ridx = self.response_start[:, None] + ar - Pw
            return torch.where(in_prompt, pidx, torch.where(in_resp, ridx, -1))

        return self._cached("full_index", build)

    def response_positions(self) -> torch.Tensor:
        """``[N]``: packed position of each valid response token, original row order."""
        return self._cached("response_positions", lambda: self.response_start[self.out_row] + self.out_col)

    def packed_response_order(self) -> torch.Tensor:
        """``[N]``: permutation from original row order to packed (group-major) order of the response tokens."""
        return self._cached("packed_response_order", lambda: torch.argsort(self.response_positions()))

    # ------------------------------------------------------------------ backend index sets
    def _cached(self, key, build):
        val = self._cache.get(key)
        if val is None:
            val = build()
            self._cache[key] = val
        return val

    def _token_segments(self):
        """Per packed token: ``(group [T], segment [T], is_prompt [T] bool)``; segment = G + row for responses."""

        def build():
            dev = self.device
            g_ar = torch.arange(self.G, device=dev)
            b_ar = torch.arange(self.B, device=dev)
            group = torch.empty(self.T, dtype=torch.long, device=dev)
            seg = torch.empty(self.T, dtype=torch.long, device=dev)
            pidx = _segments_to_tokens(self.prompt_start, self.prompt_lens, self.num_prompt_tokens)
            ridx = _segments_to_tokens(self.response_start, self.response_lens, self.N)
            pg = torch.repeat_interleave(g_ar, self.prompt_lens, output_size=self.num_prompt_tokens)
            rb = torch.repeat_interleave(b_ar, self.response_lens, output_size=self.N)
            group[pidx] = pg
            seg[pidx] = pg
            group[ridx] = self.row_group[rb]
            seg[ridx] = self.G + rb
            is_prompt = seg < self.G
            return group, seg, is_prompt

        return self._cached("token_segments", build)

    def padded_index(self):
        """Index set of the reference (padded two-call) backend.

        Returns a dict:

        * ``prompt_index [G, Pmax]``: packed position of prompt token ``l`` of group ``g`` (0 on pads);
        * ``response_index [B, Rmax]``: packed position of response token ``l`` of row ``b`` (0 on pads);
        * ``response_mask [B, 1, Rmax, Pmax + Rmax] bool``: key ``j < P_g`` of the prompt slot, or own key ``k <= q``;
        * ``out_index [T]``: position of each packed token in
          ``cat(prompt_out [G*Pmax], resp_out [B*Rmax])``.
        """

        def build():
            dev = self.device
            Pm, Rm = self.max_prompt_len, self.max_response_len
            ar_p = torch.arange(Pm, device=dev)
            ar_r = torch.arange(Rm, device=dev)
            p_valid = ar_p[None, :] < self.prompt_lens[:, None]  # [G, Pmax]
            r_valid = ar_r[None, :] < self.response_lens[:, None]  # [B, Rmax]
            prompt_index = torch.where(p_valid, self.prompt_start[:, None] + ar_p[None, :], 0)
            response_index = torch.where(r_valid, self.response_start[:, None] + ar_r[None, :], 0)
            key_prompt = ar_p[None, None, :] < self.row_prompt_lens[:, None, None]  # [B, 1, Pmax]
            key_prompt = key_prompt.expand(self.B, Rm, Pm)
            key_own = (ar_r[None, :] <= ar_r[:, None])[None].expand(self.B, Rm, Rm)  # [B, Rmax(q), Rmax(k)]
            response_mask = torch.cat([key_prompt, key_own], dim=2)[:, None]  # [B, 1, Rmax, Pmax+Rmax]
            flat_p = torch.arange(self.G * Pm, device=dev).view(self.G, Pm)
            flat_r = self.G * Pm + torch.arange(self.B * Rm, device=dev).view(self.B, Rm)
            out_index = _scatter_valid(self.T, torch.cat([prompt_index.flatten(), response_index.flatten()]),
                                       torch.cat([p_valid.flatten(), r_valid.flatten()]),
                                       torch.cat([flat_p.flatten(), flat_r.flatten()]))
            return {
                "prompt_index": prompt_index,
                "response_index": response_index,
                "response_mask": response_mask,
                "out_index": out_index,
            }

        return self._cached("padded", build)

    def row_index(self):
        """Index set of the ``standard`` backend (K/V expanded to full rows).

        * ``row_index [B, Lmax]``: packed position of token ``l`` of row ``b``'s full sequence ``[prompt | response]``
          (0 on pads; right padded so an ordinary causal mask never lets a valid query see a pad);
        * ``out_index [T]``: for each packed token its place in ``[B * Lmax]`` (prompt tokens read from the group's
          first row).
        """

        def build():
            dev = self.device
            Lm = self.max_row_len
            ar = torch.arange(Lm, device=dev)[None, :]  # [1, Lmax]
            p = self.row_prompt_lens[:, None]
            r = self.response_lens[:, None]
            pstart = self.prompt_start[self.row_group][:, None]
            idx = torch.where(ar < p, pstart + ar, self.response_start[:, None] + ar - p)
            valid = ar < p + r
            idx = torch.where(valid, idx, 0)
            flat = torch.arange(self.B * Lm, device=dev).view(self.B, Lm)
            rep = self.group_rep_row
            p_valid = ar < self.prompt_lens[:, None]  # [G, Lmax]: prompt tokens read from the group's first row
            r_valid = (ar >= p) & valid  # [B, Lmax]: every row's own response tokens
            out_index = _scatter_valid(self.T, torch.cat([idx[rep].flatten(), idx.flatten()]),
                                       torch.cat([p_valid.flatten(), r_valid.flatten()]),
                                       torch.cat([flat[rep].flatten(), flat.flatten()]))
            return {"row_index": idx, "out_index": out_index}

        return self._cached("rows", build)

    def varlen_index(self):
        """Index set of the flash-attn varlen backend (the two-call gather design, DESIGN §2).

        * call 1 (prompts, causal): ``prompt_token_index [Np]``, ``cu_seqlens_prompt [G+1] int32``,
          ``max_seqlen_prompt`` (int);
        * call 2 (each non-empty response vs ``[its prompt ; itself]``, causal bottom-right):
          ``resp_q_index [N]`` (packed order), ``resp_kv_index [K]``, ``cu_seqlens_q [Bnz+1] int32``,
          ``cu_seqlens_k [Bnz+1] int32``, ``max_seqlen_q``, ``max_seqlen_k`` (ints);
        * ``out_index [T]``: each packed token's place in ``cat(out_call1 [Np], out_call2 [N])``.
        """

        def build():
            dev = self.device
            prompt_tok = _segments_to_tokens(self.prompt_start, self.prompt_lens, self.num_prompt_tokens)
            # Non-empty responses in packed order (group-major, row order inside a group).
            key = self.row_group * self.B + torch.arange(self.B, device=dev)
            key = torch.where(self.response_lens > 0, key, key + self.G * self.B)  # empty rows last
            rows = torch.argsort(key)[: self.num_nonempty_responses]
            r = self.response_lens[rows]
            p = self.row_prompt_lens[rows]
            resp_tok = _segments_to_tokens(self.response_start[rows], r, self.N)
            # K/V segments per response: [prompt of its group (p) ; its own tokens (r)].
            starts = torch.stack([self.prompt_start[self.row_group[rows]], self.response_start[rows]], 1).flatten()
            lens = torch.stack([p, r], 1).flatten()
            kv_tok = _segments_to_tokens(starts, lens, self.kv_total)
            out_index = torch.empty(self.T, dtype=torch.long, device=dev)
            out_index[prompt_tok] = torch.arange(self.num_prompt_tokens, device=dev)
            out_index[resp_tok] = self.num_prompt_tokens + torch.arange(self.N, device=dev)
            return {
                "prompt_token_index": prompt_tok,
                "cu_seqlens_prompt": _cu_seqlens(self.prompt_lens),
                "max_seqlen_prompt": self.max_prompt_len,
                "resp_q_index": resp_tok,
                "resp_kv_index": kv_tok,
                "cu_seqlens_q": _cu_seqlens(r),
                "cu_seqlens_k": _cu_seqlens(p + r),
                "max_seqlen_q": self.max_response_len,
                "max_seqlen_k": self.max_row_len,
                "out_index": out_index,
            }

        return self._cached("varlen", build)

    def token_layout(self):
        """``(group [T], segment [T], is_prompt [T])`` per packed token, for mask-based backends (flex)."""
        return self._token_segments()

    def dense_mask(self) -> torch.Tensor:
        """The full ``[T, T]`` bool attention mask of the packed row. O(T^2): tests and tiny batches only."""
        group, seg, is_prompt = self._token_segments()
        ar = torch.arange(self.T, device=self.device)
        causal = ar[None, :] <= ar[:, None]
        same_group = group[:, None] == group[None, :]
        visible = is_prompt[None, :] | (seg[:, None] == seg[None, :])
        return causal & same_group & visible


def require_plan(plan, who: str) -> ZorroPlan:
    """The ``zorro_plan`` kwarg a sequence mixer received: a :class:`ZorroPlan`, or a clear error naming ``who``."""
    if plan is None:
        raise ValueError(f"{who}: called without a plan (the `zorro_plan` kwarg is missing). Run the model through "
                         "zorro_verl.integrations.transformers.zorro_forward, or uninstall zorro "
                         "(uninstall_zorro(model)) for an ordinary forward.")
    if not isinstance(plan, ZorroPlan):
        raise TypeError(f"zorro_plan: expected a ZorroPlan, got {type(plan).__name__}.")
    return plan


def _check_tensor(name: str, t, ndim: int, dtypes: Optional[tuple] = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}. Pass the batch's tensor.")
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got shape {tuple(t.shape)}.")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype in {[str(d) for d in dtypes]}, got {t.dtype}.")


_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
_MASK_DTYPES = (torch.bool, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.float32,
                torch.float16, torch.bfloat16, torch.float64)


def build_plan(
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    response_width: int,
    *,
    position_ids: Optional[torch.Tensor] = None,
    backend: str = "sdpa",
) -> ZorroPlan:
    """Group rows by their valid prompt tokens and build every index of the deduplicated forward.

    Args:
        input_ids: ``[B, S] int64`` — left-padded prompt ``[:, :S-R]`` + right-padded response ``[:, S-R:]``.
        attention_mask: ``[B, S]`` 0/1 (bool, int or float) — 0 on both pads; ``None`` means every token is valid.
        response_width: ``R``, the padded response width (``responses.shape[1]`` in verl); ``0 <= R < S``.
        position_ids: optional ``[B, S] int64``; if given, must equal verl's convention on valid tokens
            (``0..P-1`` over the prompt, continuing over the response), since the packed row recomputes them.
        backend: one of :data:`ATTENTION_BACKENDS`; recorded in the plan for the attention function.

    Returns:
        A :class:`ZorroPlan`. Groups are numbered by first appearance; rows need not be adjacent.

    Raises:
        ValueError / TypeError naming the field, the expectation, what was got and the fix.
    """
    _check_tensor("input_ids", input_ids, 2, _INT_DTYPES)
    if input_ids.dtype != torch.int64:
        input_ids = input_ids.long()
    B, S = input_ids.shape
    if B == 0:
        raise ValueError("input_ids: expected at least one row, got an empty batch (shape "
                         f"{tuple(input_ids.shape)}). Skip empty micro-batches before calling zorro.")
    if isinstance(response_width, bool) or not isinstance(response_width, int):
        raise TypeError(f"response_width: expected an int (responses.shape[1]), got {type(response_width).__name__}.")
    if not 0 <= response_width < S:
        raise ValueError(
            f"response_width: expected 0 <= response_width < sequence width {S} (the prompt needs at least one "
            f"column), got {response_width}. Pass responses.shape[1] of a batch whose input_ids are "
            "[prompt | response].")
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"backend: expected one of {ATTENTION_BACKENDS}, got {backend!r}.")
    dev = input_ids.device
    R = response_width
    Pw = S - R

    if attention_mask is None:
        am = torch.ones(B, S, dtype=torch.bool, device=dev)
        bad_values = torch.zeros((), dtype=torch.bool, device=dev)
    else:
        _check_tensor("attention_mask", attention_mask, 2, _MASK_DTYPES)
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask: expected shape {tuple(input_ids.shape)} (same as input_ids), got "
                             f"{tuple(attention_mask.shape)}.")
        if attention_mask.device != dev:
            raise ValueError(f"attention_mask: expected device {dev} (same as input_ids), got {attention_mask.device}.")
        bad_values = ((attention_mask != 0) & (attention_mask != 1)).any()
        am = attention_mask != 0
    if position_ids is not None:
        _check_tensor("position_ids", position_ids, 2, _INT_DTYPES)
        if position_ids.shape != input_ids.shape:
            raise ValueError(f"position_ids: expected shape {tuple(input_ids.shape)} (same as input_ids), got "
                             f"{tuple(position_ids.shape)}. 3-D (multimodal/mrope) position ids are not supported.")

    pm, rm = am[:, :Pw], am[:, Pw:]
    p_len = pm.sum(1)  # [B]
    r_len = rm.sum(1)  # [B]
    ar_p = torch.arange(Pw, device=dev)
    ar_r = torch.arange(R, device=dev)
    prompt_not_left_padded = (pm != (ar_p[None, :] >= (Pw - p_len)[:, None])).any(1)  # [B]
    resp_not_right_padded = (rm != (ar_r[None, :] < r_len[:, None])).any(1)  # [B]
    if position_ids is not None:
        expect = torch.cat([(ar_p[None, :] - (Pw - p_len)[:, None]), p_len[:, None] + ar_r[None, :]], 1)
        pos_bad = ((position_ids.long() != expect) & am).any(1)
    else:
        pos_bad = torch.zeros(B, dtype=torch.bool, device=dev)

    # Group by valid prompt tokens only: pads become -1, so a real token equal to the pad id stays a token.
    key = torch.where(pm, input_ids[:, :Pw], torch.full_like(input_ids[:, :Pw], -1))
    _, inv = torch.unique(key, dim=0, return_inverse=True)  # [B], numbered in sorted key order

    # ---- the one host sync of validation + sizes
    first_bad = lambda m: torch.where(m, torch.arange(B, device=dev), B).min()  # noqa: E731
    stats = torch.stack([
        bad_values.long(), first_bad(prompt_not_left_padded), first_bad(resp_not_right_padded),
        first_bad(p_len == 0), first_bad(pos_bad), inv.max() + 1,
    ]).tolist()
    bad_vals, b_pad_p, b_pad_r, b_empty, b_pos, G = stats
    if bad_vals:
        raise ValueError("attention_mask: expected only 0 and 1 values, got others. Pass a 0/1 padding mask "
                         "(1 = real token).")
    if b_pad_p < B:
        raise ValueError(f"attention_mask: expected the prompt part [:, :{Pw}] to be left padded (valid tokens "
                         f"contiguous at its end), row {b_pad_p} is not. Use verl's layout: left-padded prompt, "
                         "right-padded response, or check response_width.")
    if b_pad_r < B:
        raise ValueError(f"attention_mask: expected the response part [:, {Pw}:] to be right padded (valid tokens "
                         f"contiguous from its start), row {b_pad_r} is not. Tool/observation tokens belong in "
                         "response_mask, not attention_mask.")
    if b_empty < B:
        raise ValueError(f"attention_mask: row {b_empty} has no valid prompt token in its prompt part [:, :{Pw}]; "
                         "every row needs a prompt of at least one token. Check response_width and the padding.")
    if b_pos < B:
        raise ValueError(f"position_ids: row {b_pos} does not follow verl's convention (0..P-1 over the valid prompt, "
                         "continuing over the response); zorro recomputes positions on the packed row and would "
                         "change results. Pass position_ids=None or the standard ones.")

    # ---- groups in order of first appearance
    ar_b = torch.arange(B, device=dev)
    first = torch.full((G,), B, dtype=torch.long, device=dev).scatter_reduce(0, inv, ar_b, "amin")
    rank = torch.argsort(first)  # rank[k] = sorted-id of the k-th group to appear
    gid = torch.empty_like(rank)
    gid[rank] = torch.arange(G, device=dev)
    row_group = gid[inv]  # [B]
    group_rep_row = first[rank]  # [G]
    group_sizes = torch.bincount(row_group, minlength=G)
    prompt_lens = p_len[group_rep_row]  # [G]
    row_prompt_lens = p_len  # [B] (== prompt_lens[row_group])

    # ---- segment layout: [P_g, R(rows of g in row order)...] for g in order
    order = torch.argsort(row_group * B + ar_b)  # rows sorted by (group, row)
    group_first_sorted = _excl_cumsum(group_sizes)  # [G] index into `order` of each group's first row
    g_ar = torch.arange(G, device=dev)
    prompt_seg = g_ar + group_first_sorted  # [G] segment index of each prompt
    resp_seg_sorted = row_group[order] + 1 + ar_b  # [B] segment index of order[j]'s response
    seg_len = torch.empty(G + B, dtype=torch.long, device=dev)
    seg_len[prompt_seg] = prompt_lens
    seg_len[resp_seg_sorted] = r_len[order]
    seg_off = _excl_cumsum(seg_len)
    prompt_start = seg_off[prompt_seg]  # [G]
    response_start = torch.empty(B, dtype=torch.long, device=dev)
    response_start[order] = seg_off[resp_seg_sorted]

    # Second (and last) sync: sizes of everything below.
    group_resp = torch.zeros(G, dtype=torch.long, device=dev).index_add_(0, row_group, r_len)  # [G]
    answered_prompts = torch.where(group_resp > 0, prompt_lens, 0)  # [G] prompts of groups with responses
    sizes = torch.stack([
        prompt_lens.sum(), r_len.sum(), prompt_lens.max(), r_len.max() if B else r_len.sum(),
        (p_len + r_len).max(), (r_len > 0).sum(), (p_len + r_len).sum(),
        (torch.where(r_len > 0, p_len + r_len, 0)).sum(),
        (group_resp > 0).sum(), group_resp.max(), answered_prompts.max(), answered_prompts.sum(),
    ]).tolist()
    Np, N, Pmax, Rmax, Lmax, Bnz, ordinary, kv_total, Ga, max_group_resp, max_answered_p, answered_p = sizes
    T = Np + N

    # ---- packed tokens and positions
    seg_src_row = torch.empty(G + B, dtype=torch.long, device=dev)
    seg_src_row[prompt_seg] = group_rep_row
    seg_src_row[resp_seg_sorted] = order
    seg_src_col = torch.empty(G + B, dtype=torch.long, device=dev)
    seg_src_col[prompt_seg] = Pw - prompt_lens
    seg_src_col[resp_seg_sorted] = Pw
    seg_pos0 = torch.empty(G + B, dtype=torch.long, device=dev)
    seg_pos0[prompt_seg] = 0
    seg_pos0[resp_seg_sorted] = p_len[order]
    seg_of_tok = torch.repeat_interleave(torch.arange(G + B, device=dev), seg_len, output_size=T)
    local = torch.arange(T, device=dev) - seg_off[seg_of_tok]
    source_index = seg_src_row[seg_of_tok] * S + seg_src_col[seg_of_tok] + local
    packed_ids = input_ids.reshape(-1)[source_index]
    packed_pos = seg_pos0[seg_of_tok] + local

    # ---- response-predicting rows, original row order
    out_row = torch.repeat_interleave(ar_b, r_len, output_size=N)  # [N]
    out_col = torch.arange(N, device=dev) - _excl_cumsum(r_len)[out_row]
    last_prompt = (prompt_start + prompt_lens - 1)[row_group]  # [B]
    logit_index = torch.where(out_col == 0, last_prompt[out_row], response_start[out_row] + out_col - 1)
    target_ids = input_ids[out_row, Pw + out_col]

    plan = ZorroPlan(
        B=B, S=S, R=R, G=G, T=T, N=N, max_prompt_len=Pmax, max_response_len=Rmax, max_row_len=Lmax,
        num_prompt_tokens=Np, num_nonempty_responses=Bnz, ordinary_tokens=ordinary, kv_total=kv_total,
        group_counts=(Ga, max_group_resp, max_answered_p, answered_p),
        backend=backend,
        input_ids=packed_ids, position_ids=packed_pos, row_group=row_group, group_rep_row=group_rep_row,
        group_sizes=group_sizes, prompt_lens=prompt_lens, response_lens=r_len, row_prompt_lens=row_prompt_lens,
        prompt_start=prompt_start, response_start=response_start, logit_index=logit_index, target_ids=target_ids,
        out_row=out_row, out_col=out_col, source_index=source_index,
    )
    return plan
