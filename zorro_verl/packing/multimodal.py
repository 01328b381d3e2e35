"""Multimodal batches: which rows may share a prompt, and the packed row's images, videos and 3-D positions
(docs/design/model-step.md "Vision-language models"). Imports torch (and the standard library) only.

A vision-language row holds placeholder tokens (``image_token_id`` / ``video_token_id``) where the vision tower's
features go, one per merged patch: an image of grid ``(t, h, w)`` has ``t*h*w`` patch rows in ``pixel_values``
and ``t*h*w / merge**2`` placeholders. Two different images of the same size have identical placeholders, so
prompt tokens alone cannot decide sharing. Here every media item (an image or a video of a row) gets a content key
(a BLAKE2b digest of its kind, grid, dtype and pixel bytes: 62 bits; computed once per distinct tensor storage of a
batch) and its placeholders are replaced, for grouping only, by a *keyed id* ``2**62 + key`` (beyond any
vocabulary; non-negative, as the prefix tree's sort needs: its end marker -1 must sort before every token).
Grouping, prefix trees and micro-batching then run on the keyed ids unchanged: rows share a prompt (a tree node)
only where their tokens *and* media are equal. The packed row the model runs keeps the real ids.

Media may lie in the prompt or in the response (a multi-turn agent whose tool returns an image puts the image's
placeholders in the response; each item lies wholly in one of them). The packed row holds every unique prompt (tree
node) once and every response once, so its media are those of the rows its tokens were read from
(``plan.source_index``), each item once, in the order its placeholders appear: the vision tower encodes each unique
prompt's media once and each response's own media once (a prefix tree: each tree node's), and the model scatters the
features in placeholder order, as for an ordinary row. A response's items are keyed like a prompt's, so with
``sharing="prefix"`` two responses share a tree node only where their tokens and media are equal.

3-D rotary positions (Qwen2-VL family "mrope"): a token's position triple depends only on the tokens and media
before it, so a shared prompt has the same triples in every row of its group, and each response continues its own
row's. They are read from the caller's per-row positions through ``plan.source_index`` and checked against every
row's (a caller whose grouping or positions disagree gets an error, not a different forward).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from typing import Mapping, Optional, Sequence

import torch

from zorro_verl.packing.plan import ZorroPlan, build_plan

__all__ = ["MediaTokens", "MediaItem", "BatchMedia", "PackedMedia", "MEDIA_FIELDS", "IGNORED_MEDIA_KEYS",
           "batch_media", "pack_media", "packed_positions", "build_media_plan", "keyed_id", "placeholder_counts",
           "check_media_placeholders", "check_shared_positions"]

#: Per media kind: (pixel field, grid field) of a row's inputs, as Hugging Face's Qwen-VL processors name them.
MEDIA_FIELDS = {"image": ("pixel_values", "image_grid_thw"), "video": ("pixel_values_videos", "video_grid_thw")}
#: Per-row input keys accepted and not passed on: ``second_per_grid_ts`` only feeds the 3-D positions (the caller
#: supplies them: verl, or ``vision.rope_positions``, which reads it), ``images_seqlens`` (verl's agent loop) restates
#: the grids for verl's own vision forward.
IGNORED_MEDIA_KEYS = ("second_per_grid_ts", "images_seqlens")
_KEY_BITS = 62


@dataclass(frozen=True)
class MediaTokens:
    """A vision-language model's placeholder ids (None: the model has no such input) and its vision tower's
    ``spatial_merge_size`` (patches per placeholder = ``merge**2``)."""

    image_token_id: Optional[int]
    video_token_id: Optional[int]
    spatial_merge_size: int

    def token_id(self, kind: str) -> Optional[int]:
        return self.image_token_id if kind == "image" else self.video_token_id


@dataclass
class MediaItem:
    """One image or video of one row: ``pixels [t*h*w, C]`` (a slice of the row's pixel tensor), ``grid [3]
    int64``, ``tokens`` (placeholders), ``key`` (content key, ``< 2**62``), ``cols`` (host list: the ``[B, S]``
    columns of its placeholders in the row, in order) and ``in_response`` (its placeholders lie in the response, not
    the prompt). A row's items of one kind are in placeholder order, prompt items first."""

    kind: str
    pixels: torch.Tensor
    grid: torch.Tensor
    tokens: int
    key: int
    cols: list = field(repr=False)
    in_response: bool = False


@dataclass
class BatchMedia:
    """The media of a ``[B, S]`` batch: ``items[b]`` (row ``b``'s :class:`MediaItem` s in placeholder order) and
    ``keyed_ids [B, S] int64`` (``input_ids`` with each placeholder, prompt or response, replaced by its item's keyed
    id)."""

    items: list
    keyed_ids: torch.Tensor

    def select(self, rows: Sequence[int]) -> "BatchMedia":
        """The media of rows ``rows`` (a micro-batch), in that order."""
        idx = torch.as_tensor(list(rows), dtype=torch.long, device=self.keyed_ids.device)
        return BatchMedia([self.items[int(b)] for b in rows], self.keyed_ids.index_select(0, idx))


@dataclass
class PackedMedia:
    """What the model call takes besides ``input_ids``: the packed row's media in placeholder order
    (``pixel_values [sum t*h*w, C]`` / ``image_grid_thw [n, 3]``, the same for videos; None when absent) and its
    3-D positions ``position_ids [3, 1, T] int64``; ``items`` counts the unique items encoded (``response_items`` of
    them lie in responses), ``row_items`` the items of the ordinary batch (the vision tower's saving is
    ``row_items / items``)."""

    position_ids: torch.Tensor
    inputs: dict
    items: int
    row_items: int
    response_items: int = 0

    def model_kwargs(self) -> dict:
        return {k: v for k, v in self.inputs.items() if v is not None}


def keyed_id(key: int) -> int:
    """The grouping id of a placeholder whose item has content key ``key < 2**62``: ``2**62 + key``."""
    return (1 << _KEY_BITS) + key


def _content_key(kind: str, pixels: torch.Tensor, grid: torch.Tensor, memo: dict) -> int:
    """62-bit BLAKE2b key of one item's kind, grid, dtype and pixel bytes; memoised per storage view (the n rows of
    a GRPO group usually hold the same tensor objects, hashed once)."""
    tag = (kind, pixels.data_ptr(), tuple(pixels.shape), tuple(pixels.stride()), pixels.dtype,
           tuple(grid.tolist()))
    if tag in memo:
        return memo[tag]
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{kind}|{tuple(grid.tolist())}|{pixels.dtype}|{tuple(pixels.shape)}|".encode())
    h.update(pixels.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    key = int.from_bytes(h.digest(), "little") >> (64 - _KEY_BITS)
    memo[tag] = key
    return key


def _row_inputs(b: int, inputs) -> Mapping:
    if inputs is None:
        return {}
    if not isinstance(inputs, Mapping):
        raise TypeError(f"media[{b}]: expected a mapping of the row's multimodal inputs (pixel_values, "
                        f"image_grid_thw, ...) or None, got {type(inputs).__name__}.")
    known = {f for pair in MEDIA_FIELDS.values() for f in pair} | set(IGNORED_MEDIA_KEYS)
    other = sorted(k for k, v in inputs.items() if v is not None and k not in known)
    if other:
        raise ValueError(f"media[{b}]: multimodal inputs {other} are not supported by zorro (it handles "
                         f"{sorted(known)}: Qwen2-VL-family images and videos). Run this batch without zorro.")
    return inputs


def placeholder_counts(input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor],
                       tokens: MediaTokens) -> dict:
    """``input_ids [B, S]`` int, ``attention_mask [B, S]`` or None -> ``{kind: [B] host list}``: each row's
    placeholder tokens of each kind the model has a token id for, on valid tokens (one host read per kind)."""
    valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    out = {}
    for kind in MEDIA_FIELDS:
        tid = tokens.token_id(kind)
        if tid is not None:
            out[kind] = ((input_ids == tid) & valid).sum(-1).tolist()
    return out


def check_media_placeholders(input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor],
                             media: Sequence[Optional[Mapping]], tokens: MediaTokens) -> None:
    """ValueError naming the row unless each row's placeholders of each kind are exactly those of its media
    (``t*h*w / merge**2`` per grid row; both the pixels and the grid, or neither). ``input_ids [B, S]`` int,
    ``attention_mask [B, S]`` or None, ``media[b]`` row ``b``'s inputs (None or ``{}`` for a text row).

    Without it a row with placeholders and no media runs as text (the model scatters no features) and a row with
    media but no placeholders shifts every later row's grids in ``get_rope_index`` (it reads a batch's grids in
    order)."""
    B = input_ids.shape[0]
    if len(media) != B:
        raise ValueError(f"media: expected one entry per row ({B}), got {len(media)}.")
    merge2 = tokens.spatial_merge_size ** 2
    for kind, counts in placeholder_counts(input_ids, attention_mask, tokens).items():
        pix_field, grid_field = MEDIA_FIELDS[kind]
        tid = tokens.token_id(kind)
        for b, n in enumerate(counts):
            inputs = _row_inputs(b, media[b])
            pix, grid = inputs.get(pix_field), inputs.get(grid_field)
            if pix is None and grid is None:
                if n:
                    raise ValueError(f"media[{b}]: row {b} has {n} {kind} placeholder tokens (id {tid}) but no "
                                     f"{grid_field}/{pix_field}: pass the row's media or remove the placeholders.")
                continue
            if pix is None or grid is None:
                raise ValueError(f"media[{b}]: row {b} has {grid_field if pix is None else pix_field} but no "
                                 f"{pix_field if pix is None else grid_field}: pass both or neither.")
            if grid.dim() != 2 or grid.shape[1] != 3:
                raise ValueError(f"media[{b}].{grid_field}: expected a [k, 3] grid per {kind}, got "
                                 f"{tuple(grid.shape)}.")
            need = sum(int(x) // merge2 for x in grid.long().prod(-1).tolist())
            if need != n:
                raise ValueError(f"media[{b}]: row {b} has {n} {kind} placeholder tokens (id {tid}) but "
                                 f"{grid_field} {grid.tolist()} gives {need} (spatial_merge_size "
                                 f"{tokens.spatial_merge_size}): pass the row's own media with one placeholder per "
                                 "merged patch, or remove the media.")


def batch_media(input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor], response_width: int,
                media: Sequence[Optional[Mapping]], tokens: MediaTokens, memo: Optional[dict] = None) -> BatchMedia:
    """Items and keyed ids of a batch in verl's ``[B, S]`` layout (``input_ids [B, S]`` int, ``attention_mask
    [B, S]`` or None, prompts ``[:, :S-R]``).

    ``media[b]``: row ``b``'s inputs (``pixel_values [n_b, C]``, ``image_grid_thw [k_b, 3]``, video fields; None
    or ``{}`` for a text row). Each row's placeholders of a kind are assigned to its items in order, ``t*h*w /
    merge**2`` each; their count must match the grids, and each item's placeholders must lie wholly in the prompt
    (columns ``< S - response_width``) or wholly in the response (ValueError naming the row otherwise). One host read
    of the placeholder positions per batch.

    ``memo``: content keys already computed, by pixel storage view (a caller hashing the same tensors twice — a
    batch, then its micro-batches — passes one dict to both calls). Valid only while those tensors are alive: a freed
    tensor's address can be reused; start a new dict for every batch.
    """
    B, S = input_ids.shape
    if len(media) != B:
        raise ValueError(f"media: expected one entry per row ({B}), got {len(media)}.")
    if not 0 <= response_width <= S:
        raise ValueError(f"response_width: expected 0 <= response_width <= S = {S}, got {response_width}.")
    Pw = S - response_width
    valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    keyed = input_ids.long().clone()
    items: list = [[] for _ in range(B)]
    memo = {} if memo is None else memo
    merge2 = tokens.spatial_merge_size ** 2
    for kind, (pix_field, grid_field) in MEDIA_FIELDS.items():
        tid = tokens.token_id(kind)
        rows_in = [_row_inputs(b, m).get(pix_field) is not None for b, m in enumerate(media)]
        if tid is None:
            if any(rows_in):
                raise ValueError(f"media: a row has {pix_field} but the model has no {kind} placeholder token "
                                 f"({kind}_token_id is None).")
            continue
        hit = (input_ids == tid) & valid  # [B, S]
        pos = torch.nonzero(hit).tolist()  # host read: [(b, col)]
        cols_of: list = [[] for _ in range(B)]
        for b, c in pos:
            cols_of[b].append(c)
        for b in range(B):
            inputs = _row_inputs(b, media[b])
            pix, grid = inputs.get(pix_field), inputs.get(grid_field)
            cols = cols_of[b]
            if pix is None:
                if cols:
                    raise ValueError(f"media[{b}]: the row has {len(cols)} {kind} placeholder tokens (id {tid}) but "
                                     f"no {pix_field}; pass the row's multimodal inputs or remove the placeholders.")
                continue
            if grid is None or grid.dim() != 2 or grid.shape[1] != 3:
                raise ValueError(f"media[{b}].{grid_field}: expected a [k, 3] grid per {kind}, got "
                                 f"{None if grid is None else tuple(grid.shape)}.")
            patches = grid.long().prod(-1).tolist()
            need = [n // merge2 for n in patches]
            if sum(need) != len(cols) or sum(patches) != pix.shape[0]:
                raise ValueError(f"media[{b}]: {len(cols)} {kind} placeholder tokens and {pix.shape[0]} patch rows "
                                 f"of {pix_field}, but {grid_field} {grid.tolist()} gives {sum(need)} tokens and "
                                 f"{sum(patches)} patch rows (spatial_merge_size {tokens.spatial_merge_size}).")
            p0 = t0 = 0
            for i, (n_patch, n_tok, g) in enumerate(zip(patches, need, grid.long())):
                px = pix[p0:p0 + n_patch]
                key = _content_key(kind, px, g, memo)
                item_cols = cols[t0:t0 + n_tok]
                # a prompt's items are shared by its group, a response's belong to its row: an item across the
                # boundary would be both
                in_response = bool(item_cols) and item_cols[0] >= Pw
                if item_cols and in_response != (item_cols[-1] >= Pw):
                    raise ValueError(f"media[{b}]: {kind} {i} of the row has placeholder tokens (id {tid}) "
                                     f"in both the prompt and the response (columns {item_cols[0]}..{item_cols[-1]}, "
                                     f"prompt width {Pw}); put each {kind}'s placeholders wholly in the prompt or "
                                     "wholly in the response.")
                items[b].append(MediaItem(kind, px, g, n_tok, key, item_cols, in_response))
                keyed[b, item_cols] = keyed_id(key)
                p0, t0 = p0 + n_patch, t0 + n_tok
    return BatchMedia(items, keyed)


def packed_positions(plan: ZorroPlan, positions: torch.Tensor) -> torch.Tensor:
    """``positions [3, B, S]`` (or ``[4, B, S]``, verl's layout with the text positions first: dropped) int ->
    ``[3, 1, T] int64``: each packed token's triple from the row it was read from. Checked against every row's own
    triples (ValueError if a row of a shared prompt disagrees: grouping and positions would not match)."""
    if positions.dim() != 3 or positions.shape[0] not in (3, 4) or positions.shape[1:] != (plan.B, plan.S):
        raise ValueError(f"position_ids: expected [3, B, S] or [4, B, S] 3-D rotary positions with B={plan.B}, "
                         f"S={plan.S}, got {tuple(positions.shape)}.")
    pos = positions[-3:].long().reshape(3, -1)  # [3, B*S]
    packed = pos.index_select(1, plan.source_index)  # [3, T]
    full = plan.full_index().reshape(-1)  # [B*S] packed index of each batch token, -1 on pads
    ok = full >= 0
    mismatch = (pos[:, ok] != packed[:, full[ok]]).any()
    if bool(mismatch):
        raise ValueError("position_ids: rows that share a prompt have different 3-D positions on it; zorro computes "
                         "a shared prompt once, so its positions must equal in every row of its group. Pass the "
                         "positions the model's get_rope_index gives for each row.")
    return packed[:, None, :]


def check_shared_positions(keyed_ids: torch.Tensor, lengths: torch.Tensor, positions: torch.Tensor,
                           shared_cap: Optional[torch.Tensor] = None) -> None:
    """Before any plan exists (so before the ranks agree on a batch's path): rows whose valid tokens start alike must
    have equal 3-D positions on what they share, as :func:`packed_positions` later requires of a plan.

    ``keyed_ids [B, S] int64`` (right-padded valid tokens, media placeholders keyed by content:
    :attr:`BatchMedia.keyed_ids`), ``lengths [B] int64`` (valid tokens per row), ``positions [k, B, S]`` int
    (``k`` = 3 or 4, the last three the rotary axes), ``shared_cap [B] int64`` (optional: the most a row can share,
    its prompt length, for prompt sharing; None: any common prefix, for a prefix tree). The rows are compared in
    lexicographic order of their tokens, each with its neighbour on their common prefix: every pair's common prefix
    is covered through the chain. One host read of the tokens per batch. ValueError naming the two rows."""
    B = keyed_ids.shape[0]
    if B < 2:
        return
    ids, pos = keyed_ids.cpu(), positions[-3:].cpu()  # the batch's one host read; the rest runs on the host
    n = lengths.tolist()
    order = sorted(range(B), key=lambda b: ids[b, :n[b]].tolist())
    cap = None if shared_cap is None else shared_cap.tolist()
    for a, b in zip(order, order[1:]):
        m = min(n[a], n[b]) if cap is None else min(n[a], n[b], cap[a], cap[b])
        lcp = int((ids[a, :m] == ids[b, :m]).cumprod(0).sum())
        if lcp and bool((pos[:, a, :lcp] != pos[:, b, :lcp]).any()):
            raise ValueError(f"position_ids: rows {a} and {b} share their first {lcp} tokens but have different 3-D "
                             "positions on them; zorro computes shared tokens once, so their positions must be equal "
                             "in every row that shares them. Pass the positions the model's get_rope_index gives for "
                             "each row.")


def pack_media(plan: ZorroPlan, media: BatchMedia, positions: torch.Tensor) -> PackedMedia:
    """The packed row's media (each item once, in placeholder order: a unique prompt's items in its prompt segment,
    a response's own items in its response segment) and 3-D positions, for ``plan`` built from
    ``media.keyed_ids`` (:func:`build_media_plan`). Raises if an item's placeholders are not all in the packed row,
    in order (cannot happen for plans built from the keyed ids; checked since the model would scatter wrong
    features otherwise)."""
    S = plan.S
    src = plan.source_index.tolist()  # host read, once per micro-batch
    owner: dict = {}
    for b, row in enumerate(media.items):
        for i, it in enumerate(row):
            for o, c in enumerate(it.cols):
                owner[b * S + c] = (b, i, o)
    inputs: dict = {}
    n_items = n_response = 0
    for kind, (pix_field, grid_field) in MEDIA_FIELDS.items():
        # the model scatters an item's features over the placeholders of its kind in packed order: each chosen
        # item's placeholders must follow one another there, complete, first to last
        chosen: list = []
        cur, nxt = None, 0
        for s in src:
            hit = owner.get(s)
            if hit is None or media.items[hit[0]][hit[1]].kind != kind:
                continue
            it, o = media.items[hit[0]][hit[1]], hit[2]
            if cur is None and o == 0:
                cur, nxt = it, 0
                chosen.append(it)
            if it is not cur or o != nxt:
                raise ValueError(f"pack_media: a {kind} item's placeholders are cut or out of order in the packed "
                                 "row; build the plan from the media's keyed ids (build_media_plan).")
            nxt += 1
            if nxt == it.tokens:
                cur = None
        if cur is not None:
            raise ValueError(f"pack_media: a {kind} item's placeholders are cut in the packed row; build the plan "
                             "from the media's keyed ids (build_media_plan).")
        # on the plan's device: the rows' inputs may stay on the host (verl keeps non-tensor data where it was)
        dev = plan.device
        inputs[pix_field] = torch.cat([it.pixels for it in chosen]).to(dev, non_blocking=True) if chosen else None
        inputs[grid_field] = torch.stack([it.grid for it in chosen]).to(dev) if chosen else None
        n_items += len(chosen)
        n_response += sum(it.in_response for it in chosen)
    # every row's items must be the packed items its placeholders map to (equal content): a plan grouped on the
    # real ids would put B's placeholders on A's image
    full = plan.full_index().reshape(-1).tolist()
    for b, row in enumerate(media.items):
        for it in row:
            ob, oi, _ = owner[src[full[b * S + it.cols[0]]]]
            if media.items[ob][oi].key != it.key:
                raise ValueError(f"pack_media: row {b} would share a packed {it.kind} with row {ob} although their "
                                 "pixels differ; build the plan from the media's keyed ids (build_media_plan).")
    row_items = sum(len(row) for row in media.items)
    return PackedMedia(packed_positions(plan, positions), inputs, n_items, row_items, n_response)


def build_media_plan(input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor], response_width: int,
                     media: Sequence[Optional[Mapping]] | BatchMedia, tokens: MediaTokens, positions: torch.Tensor,
                     *, sharing: str = "prompt", min_shared_len: Optional[int] = None
                     ) -> tuple[ZorroPlan, PackedMedia]:
    """:func:`~zorro_verl.packing.build_plan` of a multimodal batch: grouping (or the prefix tree) on the keyed ids
    (tokens and media equal), the packed row on the real ids, plus its :class:`PackedMedia`.

    ``input_ids [B, S]`` int, ``attention_mask [B, S]`` or None, ``media`` per-row inputs (or their
    :class:`BatchMedia`), ``positions [3 | 4, B, S]`` int (the rows' 3-D rotary positions; verl's 4-row layout's
    text row is dropped), ``sharing`` / ``min_shared_len`` as for ``build_plan``.
    """
    bm = media if isinstance(media, BatchMedia) else batch_media(input_ids, attention_mask, response_width, media,
                                                                 tokens)
    plan = build_plan(bm.keyed_ids, attention_mask, response_width, sharing=sharing, min_shared_len=min_shared_len)
    # the real ids: the packed row the model embeds, and the predicted tokens (a response's placeholders are targets
    # too, keyed in bm.keyed_ids)
    ids = input_ids.long()
    plan = replace(plan, input_ids=ids.reshape(-1)[plan.source_index],
                   target_ids=ids[plan.out_row, plan.S - plan.R + plan.out_col])
    return plan, pack_media(plan, bm, positions)
