"""The per-micro-batch plan: the core index tensors of the deduplicated forward, built once.

Notation (docs/design/math.md), used in every docstring of the package:

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

The plan holds core data only, plus a :class:`PlanMemo` in which each consumer (an attention backend, the
recurrent layers) keeps the index set it derives from the core data. Which backend runs and how many layers ran
are not the plan's business (:mod:`zorro_verl.integrations.transformers.context`).

This module imports torch only. All host synchronisation of the micro-batch happens in :func:`build_plan`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from zorro_verl.packing.grouping import group_ids
from zorro_verl.packing.segments import excl_cumsum, segments_to_tokens
from zorro_verl.packing.tree import (
    DEFAULT_MIN_SHARED_LEN,
    PrefixTree,
    check_min_shared_len,
    check_sharing,
    child_buckets,
    path_index,
    sorted_sequences,
    trie_nodes,
)

__all__ = ["ZorroPlan", "PlanMemo", "build_plan", "build_tree_plan"]


class PlanMemo:
    """Index sets derived from a plan, built on first use, keyed by their owner (e.g. a backend's name).

    Deliberately *not* a dict: FSDP2 (and other ``tree_map``-style input casts) rebuild dataclasses and dicts
    found in forward kwargs; an opaque holder is passed through by reference, so a plan copied that way still shares
    the index sets built by the original.
    """

    __slots__ = ("_data",)

    def __init__(self):
        self._data: dict = {}

    def get(self, key, build: Callable[[], object]):
        """The value stored under ``key``, built by ``build()`` on first use."""
        val = self._data.get(key)
        if val is None:
            val = build()
            self._data[key] = val
        return val

    def __contains__(self, key) -> bool:
        return key in self._data


@dataclass
class ZorroPlan:
    """Every core index of one micro-batch's deduplicated forward. Built by :func:`build_plan`; never mutated after.

    Python ints (no host sync needed downstream): ``B, S, R, G, T, N, max_prompt_len, max_response_len,
    max_row_len, num_prompt_tokens, num_nonempty_responses, ordinary_tokens`` (tokens of the ordinary per-row
    forward, ``sum_b P_b + r_b``), ``kv_total`` (``sum`` of ``P_b + r_b`` over rows with a response: the keys of a
    per-response ``[prompt ; itself]`` gather), ``group_counts`` (groups with at least one response token, the most
    response tokens of a group, and the longest / total prompt of such groups).

    Tensors (all on the batch's device, int64):

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
    memo: PlanMemo = field(default_factory=PlanMemo, repr=False, compare=False)
    #: The prefix tree (:class:`~zorro_verl.packing.tree.PrefixTree`) of a ``sharing="prefix"`` plan; None for the
    #: prompt plan. Every backend branches on it.
    tree: Optional[object] = field(default=None, repr=False, compare=False)
    #: Tree plans: ``head_index [Nh]`` the distinct packed positions of ``logit_index`` (the LM head runs there
    #: once) and ``head_inverse [N]`` each output's row in it. None for the prompt plan (``logit_index`` itself).
    head_index: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)
    head_inverse: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)

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

    # ------------------------------------------------------------------ verl layout <-> response tokens
    def to_padded(self, values: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """Scatter per-response-token values ``[N, ...]`` into verl's layout ``[B, R, ...]`` (``fill`` on pads)."""
        out = values.new_full((self.B, self.R, *values.shape[1:]), fill)
        return out.index_put((self.out_row, self.out_col), values)

    def from_padded(self, padded: torch.Tensor) -> torch.Tensor:
        """Gather ``[B, R, ...]`` at the valid response tokens -> ``[N, ...]`` (original row order)."""
        return padded[self.out_row, self.out_col]

    def _prompt_plan_only(self, name: str) -> None:
        """Layouts of prompt / response segments do not exist for a prefix tree (its segments are the nodes)."""
        if self.tree is not None:
            raise ValueError(f"plan.{name}: a layout of the prompt plan; this plan is a prefix tree "
                             "(sharing='prefix'), whose segments are plan.tree's nodes.")

    # ------------------------------------------------------------------ derived layouts (memoised)
    def full_index(self) -> torch.Tensor:
        """``[B, S]``: the packed position each token of the verl batch maps to (-1 on pads)."""

        def build():
            dev = self.device
            Pw = self.S - self.R
            ar = torch.arange(self.S, device=dev)[None, :]
            p = self.row_prompt_lens[:, None]
            r = self.response_lens[:, None]
            if self.tree is not None:  # a row's token at depth t lies on its root path
                depth = ar - (Pw - p)  # [B, S]
                valid = (depth >= 0) & (depth < p + r)
                idx = path_index(self.tree, self.tree.row_node, depth.clamp(min=0).minimum(p + r - 1))
                return torch.where(valid, idx, -1)
            in_prompt = (ar >= Pw - p) & (ar < Pw)
            in_resp = (ar >= Pw) & (ar < Pw + r)
            pidx = self.prompt_start[self.row_group][:, None] + ar - (Pw - p)
            ridx = self.response_start[:, None] + ar - Pw
            return torch.where(in_prompt, pidx, torch.where(in_resp, ridx, -1))

        return self.memo.get("full_index", build)

    def response_positions(self) -> torch.Tensor:
        """``[N]``: packed position of each valid response token, original row order."""
        self._prompt_plan_only("response_positions")
        return self.memo.get("response_positions", lambda: self.response_start[self.out_row] + self.out_col)

    def packed_response_order(self) -> torch.Tensor:
        """``[N]``: permutation from original row order to packed (group-major) order of the response tokens."""
        return self.memo.get("packed_response_order", lambda: torch.argsort(self.response_positions()))

    def token_layout(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per packed token: ``(group [T] int64, segment [T] int64, is_prompt [T] bool)``; a prompt's segment is
        its group id, a response's is ``G + row``."""
        self._prompt_plan_only("token_layout")

        def build():
            dev = self.device
            group = torch.empty(self.T, dtype=torch.long, device=dev)
            seg = torch.empty(self.T, dtype=torch.long, device=dev)
            pidx = segments_to_tokens(self.prompt_start, self.prompt_lens, self.num_prompt_tokens)
            ridx = segments_to_tokens(self.response_start, self.response_lens, self.N)
            pg = torch.repeat_interleave(torch.arange(self.G, device=dev), self.prompt_lens,
                                         output_size=self.num_prompt_tokens)
            rb = torch.repeat_interleave(torch.arange(self.B, device=dev), self.response_lens, output_size=self.N)
            group[pidx] = pg
            seg[pidx] = pg
            group[ridx] = self.row_group[rb]
            seg[ridx] = self.G + rb
            return group, seg, seg < self.G

        return self.memo.get("token_layout", build)

    def nonempty_rows(self) -> torch.Tensor:
        """``[Bnz] int64``: rows with a non-empty response in packed order (group-major, row order inside a
        group)."""
        self._prompt_plan_only("nonempty_rows")

        def build():
            key = self.row_group * self.B + torch.arange(self.B, device=self.device)
            key = torch.where(self.response_lens > 0, key, key + self.G * self.B)  # empty rows last
            return torch.argsort(key)[: self.num_nonempty_responses]

        return self.memo.get("nonempty_rows", build)


# ---------------------------------------------------------------------------------------------------- building
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


def _check_inputs(input_ids, attention_mask, response_width, position_ids) -> None:
    """Types and shapes (no device work)."""
    _check_tensor("input_ids", input_ids, 2, _INT_DTYPES)
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
    if attention_mask is not None:
        _check_tensor("attention_mask", attention_mask, 2, _MASK_DTYPES)
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask: expected shape {tuple(input_ids.shape)} (same as input_ids), got "
                             f"{tuple(attention_mask.shape)}.")
        if attention_mask.device != input_ids.device:
            raise ValueError(f"attention_mask: expected device {input_ids.device} (same as input_ids), got "
                             f"{attention_mask.device}.")
    if position_ids is not None:
        _check_tensor("position_ids", position_ids, 2, _INT_DTYPES)
        if position_ids.shape != input_ids.shape:
            raise ValueError(f"position_ids: expected shape {tuple(input_ids.shape)} (same as input_ids), got "
                             f"{tuple(position_ids.shape)}. 3-D (multimodal/mrope) position ids are not supported.")


def _layout_violations(am: torch.Tensor, attention_mask, position_ids, Pw: int) -> list[torch.Tensor]:
    """Device-side checks of verl's layout, each a 0-d tensor: a bad-mask-values flag and the first offending row
    (``B`` if none) for: prompt not left padded, response not right padded, empty prompt, bad positions."""
    B, S = am.shape
    dev = am.device
    pm, rm = am[:, :Pw], am[:, Pw:]
    p_len, r_len = pm.sum(1), rm.sum(1)
    ar_p = torch.arange(Pw, device=dev)
    ar_r = torch.arange(S - Pw, device=dev)
    bad_values = (((attention_mask != 0) & (attention_mask != 1)).any() if attention_mask is not None
                  else torch.zeros((), dtype=torch.bool, device=dev))
    not_left_padded = (pm != (ar_p[None, :] >= (Pw - p_len)[:, None])).any(1)
    not_right_padded = (rm != (ar_r[None, :] < r_len[:, None])).any(1)
    if position_ids is not None:
        expect = torch.cat([(ar_p[None, :] - (Pw - p_len)[:, None]), p_len[:, None] + ar_r[None, :]], 1)
        pos_bad = ((position_ids.long() != expect) & am).any(1)
    else:
        pos_bad = torch.zeros(B, dtype=torch.bool, device=dev)
    first_bad = lambda m: torch.where(m, torch.arange(B, device=dev), B).min()  # noqa: E731
    return [bad_values.long(), first_bad(not_left_padded), first_bad(not_right_padded), first_bad(p_len == 0),
            first_bad(pos_bad)]


def _raise_layout(bad_vals: int, b_pad_p: int, b_pad_r: int, b_empty: int, b_pos: int, B: int, Pw: int) -> None:
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


def _prepare(input_ids, attention_mask, response_width, position_ids):
    """Checked inputs of both plan builders: ``(input_ids [B, S] int64, am [B, S] bool, p_len [B], r_len [B])``."""
    _check_inputs(input_ids, attention_mask, response_width, position_ids)
    input_ids = input_ids.long()
    B, S = input_ids.shape
    Pw = S - response_width
    am = torch.ones(B, S, dtype=torch.bool, device=input_ids.device) if attention_mask is None else attention_mask != 0
    return input_ids, am, am[:, :Pw].sum(1), am[:, Pw:].sum(1)


def _segment_layout(row_group: torch.Tensor, G: int, prompt_lens: torch.Tensor, r_len: torch.Tensor):
    """Segments of the packed row: ``[P_g, R(rows of g in row order)...]`` for g in order.

    Returns ``(order [B], prompt_seg [G], resp_seg [B], seg_len [G+B], seg_off [G+B])``: rows sorted by (group,
    row), each prompt's and each sorted row's segment index, segment lengths and offsets."""
    B = row_group.numel()
    dev = row_group.device
    ar_b = torch.arange(B, device=dev)
    group_sizes = torch.bincount(row_group, minlength=G)
    order = torch.argsort(row_group * B + ar_b)  # rows sorted by (group, row)
    prompt_seg = torch.arange(G, device=dev) + excl_cumsum(group_sizes)  # [G]
    resp_seg = row_group[order] + 1 + ar_b  # [B] segment of order[j]'s response
    seg_len = torch.empty(G + B, dtype=torch.long, device=dev)
    seg_len[prompt_seg] = prompt_lens
    seg_len[resp_seg] = r_len[order]
    return order, prompt_seg, resp_seg, seg_len, excl_cumsum(seg_len), group_sizes


def build_plan(
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    response_width: int,
    *,
    position_ids: Optional[torch.Tensor] = None,
    sharing: str = "prompt",
    min_shared_len: Optional[int] = None,
) -> ZorroPlan:
    """Group rows by their valid prompt tokens and build every core index of the deduplicated forward.

    Args:
        input_ids: ``[B, S] int64`` — left-padded prompt ``[:, :S-R]`` + right-padded response ``[:, S-R:]``.
        attention_mask: ``[B, S]`` 0/1 (bool, int or float) — 0 on both pads; ``None`` means every token is valid.
        response_width: ``R``, the padded response width (``responses.shape[1]`` in verl); ``0 <= R < S``.
        position_ids: optional ``[B, S] int64``; if given, must equal verl's convention on valid tokens
            (``0..P-1`` over the prompt, continuing over the response), since the packed row recomputes them.
        sharing: ``"prompt"`` (rows with identical prompts share them) or ``"prefix"`` (every common prefix: the
            prefix-tree plan of :func:`~zorro_verl.packing.tree.build_tree_plan`, ``plan.tree`` set).
        min_shared_len: ``sharing="prefix"`` only: tokens a shared tree node must add over its parent (default
            :data:`~zorro_verl.packing.tree.DEFAULT_MIN_SHARED_LEN`).

    Returns:
        A :class:`ZorroPlan`. Groups are numbered by first appearance; rows need not be adjacent.

    Raises:
        ValueError / TypeError naming the field, the expectation, what was got and the fix.
    """
    if check_sharing(sharing) == "prefix":
        return build_tree_plan(input_ids, attention_mask, response_width, position_ids=position_ids,
                               min_shared_len=DEFAULT_MIN_SHARED_LEN if min_shared_len is None else min_shared_len)
    if min_shared_len is not None:
        raise ValueError(f"min_shared_len: only used with sharing='prefix', got {min_shared_len!r} with "
                         "sharing='prompt'. Drop it or pass sharing='prefix'.")
    input_ids, am, p_len, r_len = _prepare(input_ids, attention_mask, response_width, position_ids)
    B, S = input_ids.shape
    dev = input_ids.device
    R = response_width
    Pw = S - R
    row_group = group_ids(input_ids[:, :Pw], am[:, :Pw])  # [B], ids by first appearance

    # ---- first host sync: layout checks and the group count
    *checks, G = torch.stack([*_layout_violations(am, attention_mask, position_ids, Pw),
                              row_group.max() + 1]).tolist()
    _raise_layout(*checks, B=B, Pw=Pw)

    group_rep_row = torch.full((G,), B, dtype=torch.long, device=dev).scatter_reduce(
        0, row_group, torch.arange(B, device=dev), "amin")  # [G] first row of each group
    prompt_lens = p_len[group_rep_row]  # [G]
    order, prompt_seg, resp_seg, seg_len, seg_off, group_sizes = _segment_layout(row_group, G, prompt_lens, r_len)
    prompt_start = seg_off[prompt_seg]  # [G]
    response_start = torch.empty(B, dtype=torch.long, device=dev)
    response_start[order] = seg_off[resp_seg]

    # ---- second (and last) host sync: every size downstream code needs
    group_resp = torch.zeros(G, dtype=torch.long, device=dev).index_add_(0, row_group, r_len)  # [G]
    answered_prompts = torch.where(group_resp > 0, prompt_lens, 0)  # [G] prompts of groups with responses
    Np, N, Pmax, Rmax, Lmax, Bnz, ordinary, kv_total, Ga, max_group_resp, max_answered_p, answered_p = torch.stack([
        prompt_lens.sum(), r_len.sum(), prompt_lens.max(), r_len.max(), (p_len + r_len).max(), (r_len > 0).sum(),
        (p_len + r_len).sum(), torch.where(r_len > 0, p_len + r_len, 0).sum(),
        (group_resp > 0).sum(), group_resp.max(), answered_prompts.max(), answered_prompts.sum(),
    ]).tolist()
    T = Np + N

    # ---- packed tokens and positions: each segment is read from one verl row, from one column on
    seg_src_row = torch.empty(G + B, dtype=torch.long, device=dev)
    seg_src_row[prompt_seg] = group_rep_row
    seg_src_row[resp_seg] = order
    seg_src_col = torch.empty(G + B, dtype=torch.long, device=dev)
    seg_src_col[prompt_seg] = Pw - prompt_lens
    seg_src_col[resp_seg] = Pw
    seg_pos0 = torch.empty(G + B, dtype=torch.long, device=dev)
    seg_pos0[prompt_seg] = 0
    seg_pos0[resp_seg] = p_len[order]
    seg_of_tok = torch.repeat_interleave(torch.arange(G + B, device=dev), seg_len, output_size=T)
    local = torch.arange(T, device=dev) - seg_off[seg_of_tok]
    source_index = seg_src_row[seg_of_tok] * S + seg_src_col[seg_of_tok] + local

    # ---- response-predicting rows, original row order
    out_row = torch.repeat_interleave(torch.arange(B, device=dev), r_len, output_size=N)  # [N]
    out_col = torch.arange(N, device=dev) - excl_cumsum(r_len)[out_row]
    last_prompt = (prompt_start + prompt_lens - 1)[row_group]  # [B]
    logit_index = torch.where(out_col == 0, last_prompt[out_row], response_start[out_row] + out_col - 1)

    return ZorroPlan(
        B=B, S=S, R=R, G=G, T=T, N=N, max_prompt_len=Pmax, max_response_len=Rmax, max_row_len=Lmax,
        num_prompt_tokens=Np, num_nonempty_responses=Bnz, ordinary_tokens=ordinary, kv_total=kv_total,
        group_counts=(Ga, max_group_resp, max_answered_p, answered_p),
        input_ids=input_ids.reshape(-1)[source_index], position_ids=seg_pos0[seg_of_tok] + local,
        row_group=row_group, group_rep_row=group_rep_row, group_sizes=group_sizes, prompt_lens=prompt_lens,
        response_lens=r_len, row_prompt_lens=p_len, prompt_start=prompt_start, response_start=response_start,
        logit_index=logit_index, target_ids=input_ids[out_row, Pw + out_col], out_row=out_row, out_col=out_col,
        source_index=source_index,
    )


def build_tree_plan(input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor], response_width: int, *,
                    position_ids: Optional[torch.Tensor] = None, min_shared_len: int = DEFAULT_MIN_SHARED_LEN):
    """The prefix-tree :class:`~zorro_verl.packing.ZorroPlan` (``plan.tree`` set). Arguments as
    build_plan (which calls this for ``sharing="prefix"``), plus ``min_shared_len``.

    Fields of the plan for a tree: ``G`` / ``row_group`` / ``group_sizes`` / ``group_rep_row`` count trie
    **clusters** (roots: rows sharing anything); ``prompt_start`` / ``prompt_lens`` are the roots' packed offsets
    and lengths; ``response_start`` is -1 (a row's response may span several nodes). Everything else keeps its
    meaning; every backend reads ``plan.tree``.
    """
    check_min_shared_len(min_shared_len)
    input_ids, am, p_len, r_len = _prepare(input_ids, attention_mask, response_width, position_ids)
    B, S = input_ids.shape
    dev = input_ids.device
    R = response_width
    Pw = S - R
    inv, lens, lcp, first = sorted_sequences(input_ids, am, Pw)
    U = lens.numel()

    # ---- the host read: layout checks, sizes and the sorted sequences' neighbour LCPs
    checks = torch.stack([*_layout_violations(am, attention_mask, position_ids, Pw), r_len.sum(),
                          (r_len > 0).sum(), (p_len + r_len).sum(), (p_len + r_len).max(), r_len.max()])
    host = torch.cat([checks, lens, lcp, inv, p_len]).tolist()
    *chk, N, Bnz, ordinary, Lmax, Rmax = host[:10]
    _raise_layout(*chk, B=B, Pw=Pw)
    lens_h, lcp_h = host[10:10 + U], host[10 + U:10 + 2 * U - 1]
    plens_h: list = [set() for _ in range(U)]  # prompt lengths of the rows holding each sequence
    for u, pl in zip(host[9 + 2 * U:9 + 2 * U + B], host[9 + 2 * U + B:]):
        plens_h[u].add(pl)
    nodes, end_node = trie_nodes(lcp_h, lens_h, plens_h, min_shared_len)

    # ---- node tables (host lists of O(B) ints -> device)
    M = len(nodes)
    pos0 = [n[0] for n in nodes]
    nlen = [n[1] for n in nodes]
    parent = [n[2] for n in nodes]
    depth = [n[3] for n in nodes]
    start = [0] * M
    acc = 0
    for i in range(M):
        start[i] = acc
        acc += nlen[i]
    T = acc
    sub = list(nlen)
    for i in range(M - 1, -1, -1):  # DFS pre-order: children come after their parent
        if parent[i] >= 0:
            sub[parent[i]] += sub[i]
    levels = max(depth) + 1
    anc = []
    for i in range(M):
        row = (anc[parent[i]][:depth[i]] if parent[i] >= 0 else []) + [i]
        anc.append(row + [-1] * (levels - len(row)))
    level_counts = []
    for lv in range(levels):
        ids = [i for i in range(M) if depth[i] == lv and sub[i] > nlen[i]]
        level_counts.append((len(ids), sum(nlen[i] for i in ids), sum(sub[i] - nlen[i] for i in ids),
                             max((nlen[i] for i in ids), default=0), max((sub[i] - nlen[i] for i in ids), default=0)))
    roots_h = [i for i in range(M) if parent[i] < 0]
    kids_h = [i for i in range(M) if parent[i] >= 0]
    order_h, buckets = child_buckets([nlen[i] for i in kids_h], [pos0[i] for i in kids_h])
    # one host -> device copy of every node table, split on the device
    flat = torch.tensor(start + nlen + pos0 + parent + depth + sub + [n[4] for n in nodes] + roots_h + kids_h
                        + order_h + end_node + [a for row in anc for a in row], dtype=torch.long).to(dev)
    (node_start, node_len, node_pos0, node_parent, node_depth, node_subl, rep_seq, roots, kids, child_order, end_t,
     anc_t) = torch.split(flat, [M] * 7 + [len(roots_h), len(kids_h), len(kids_h), U, M * levels])
    node_anc = anc_t.view(M, levels)
    node_rep_row = first[rep_seq]
    row_node = end_t[inv]  # [B]
    token_node = torch.repeat_interleave(torch.arange(M, device=dev), node_len, output_size=T)  # [T]
    local = torch.arange(T, device=dev) - node_start[token_node]
    tree = PrefixTree(
        M=M, levels=levels, num_roots=len(roots_h), num_children=len(kids_h),
        root_tokens=sum(nlen[i] for i in roots_h), child_tokens=sum(nlen[i] for i in kids_h),
        max_root_len=max(nlen[i] for i in roots_h), max_child_len=max((nlen[i] for i in kids_h), default=0),
        max_anc_len=max((pos0[i] for i in kids_h), default=0),
        max_path_len=max((pos0[i] + nlen[i] for i in kids_h), default=0),
        kv_total=sum(pos0[i] + nlen[i] for i in kids_h), level_counts=tuple(level_counts),
        level_sizes=tuple((sum(1 for i in range(M) if depth[i] == lv),
                           max(nlen[i] for i in range(M) if depth[i] == lv)) for lv in range(levels)),
        child_buckets=buckets,
        node_start=node_start, node_len=node_len, node_pos0=node_pos0, node_parent=node_parent,
        node_depth=node_depth, node_sub_end=node_start + node_subl, node_anc=node_anc, node_rep_row=node_rep_row,
        roots=roots, children=kids, child_order=child_order, row_node=row_node, token_node=token_node,
    )

    # ---- packed tokens: each node is read from one row passing through it (the verl layout is contiguous over a
    # row's valid tokens: column Pw - p + depth)
    rep = node_rep_row[token_node]
    depth_tok = node_pos0[token_node] + local  # [T] = position
    source_index = rep * S + Pw - p_len[rep] + depth_tok

    # ---- response-predicting rows, original row order; the head runs once per distinct packed position
    out_row = torch.repeat_interleave(torch.arange(B, device=dev), r_len, output_size=N)  # [N]
    out_col = torch.arange(N, device=dev) - excl_cumsum(r_len)[out_row]
    logit_index = path_index(tree, row_node[out_row], (p_len[out_row] + out_col - 1)[:, None])[:, 0]  # [N]
    head_index, head_inverse = torch.unique(logit_index, return_inverse=True)  # [Nh], [N]

    # ---- cluster view (the roots) for metrics and callers that count groups
    root_of_row = node_anc[row_node, 0]  # [B] node id of each row's root
    root_rank = torch.full((M,), -1, dtype=torch.long, device=dev)
    root_rank[roots] = torch.arange(len(roots_h), device=dev)
    row_group = root_rank[root_of_row]
    G = len(roots_h)
    group_sizes = torch.bincount(row_group, minlength=G)
    group_rep_row = node_rep_row[roots]
    return ZorroPlan(
        B=B, S=S, R=R, G=G, T=T, N=N, max_prompt_len=tree.max_root_len, max_response_len=Rmax, max_row_len=Lmax,
        num_prompt_tokens=tree.root_tokens, num_nonempty_responses=Bnz, ordinary_tokens=ordinary,
        kv_total=tree.kv_total, group_counts=(0, 0, 0, 0),
        input_ids=input_ids.reshape(-1)[source_index], position_ids=depth_tok,
        row_group=row_group, group_rep_row=group_rep_row, group_sizes=group_sizes, prompt_lens=node_len[roots],
        response_lens=r_len, row_prompt_lens=p_len, prompt_start=node_start[roots],
        response_start=torch.full((B,), -1, dtype=torch.long, device=dev),
        logit_index=logit_index, target_ids=input_ids[out_row, Pw + out_col], out_row=out_row, out_col=out_col,
        source_index=source_index, tree=tree, head_index=head_index, head_inverse=head_inverse,
    )
