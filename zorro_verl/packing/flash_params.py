"""flash-attn varlen parameters (``cu_seqlens``, ``max_seqlen``) from a mask. Imports torch only.

Two inputs, two functions, never guessed from the shape:

* :func:`flash_params_from_attention_mask` — a *self-attention* mask ``[q, k]`` (also ``[1, q, k]`` and
  ``[1, 1, q, k]``) made of causal blocks along the diagonal, one block per packed sequence. With ``q == k`` the
  blocks are square (ordinary causal); with ``q != k`` each block may be bottom-right aligned (flash-attn's causal
  convention: a block with ``k_len >= q_len`` lets its query ``i`` see its keys ``j <= i + k_len - q_len``). The mask
  must be *exactly* the block-causal mask of the parameters found, or a ``ValueError`` says where it is not.
* :func:`flash_params_from_padding_mask` — a padding mask ``[n, L]``: one sequence per row, its valid-token count is
  its length.

Mask values (attention masks):

* ``bool``: True = attend. Integers: nonzero = attend (negative values are refused).
* Floats are either *multiplicative* — every value 0 or 1, 1 = attend — or *additive* (the bias added to the scores,
  as transformers builds it) — every value 0 (attend) or masked: ``-inf`` or ``<= -1e4`` (``finfo.min``, ``-1e9`` and
  ``-1e4`` conventions). A float mask with any negative value is read as additive. Anything else (NaN, soft biases
  such as ``-0.5`` or ``0.3``, 1 mixed with negatives) is refused: no ``cu_seqlens`` can express it. An all-zero float
  mask is read as additive (everything attended): read as multiplicative it would attend nothing, which is never a
  valid mask, so that is the only reading that can be meant (it is valid only as ``[1, k]``: one query, one block).
"""

from __future__ import annotations

from typing import Optional, Union

import torch

__all__ = ["flash_params_from_attention_mask", "flash_params_from_padding_mask", "ADDITIVE_MASKED_AT_MOST"]

#: An additive float mask's entries at or below this value (and ``-inf``) are masked; 0 is attended.
ADDITIVE_MASKED_AT_MOST = -1e4

_FIX = ("Pass a [q, k] self-attention mask of causal blocks along the diagonal (one block per sequence), or a "
        "padding mask [n, L] to flash_params_from_padding_mask.")


def _params(cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int, device) -> dict:
    """The flash-attn vocabulary: ``cu_seqlens_q/k [n+1] int32`` on ``device``, ``max_seqlen_q/k``,
    ``num_sequences`` (Python ints)."""
    if device is not None:
        cu_q, cu_k = cu_q.to(device), cu_k.to(device)
    return {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "max_seqlen_q": max_q, "max_seqlen_k": max_k,
            "num_sequences": cu_q.numel() - 1}


def _attend_of(attention_mask) -> torch.Tensor:
    """Validate the container and the values of an attention mask: ``[q, k] bool``, True = attend."""
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask: expected a torch.Tensor [q, k] (or [1, q, k], [1, 1, q, k]), got "
                        f"{type(attention_mask).__name__}. {_FIX}")
    shape = tuple(attention_mask.shape)
    if attention_mask.dim() not in (2, 3, 4):
        raise ValueError(f"attention_mask: expected a 2-D [q, k], 3-D [1, q, k] or 4-D [1, 1, q, k] tensor, got shape "
                         f"{shape}. {_FIX}")
    if any(d != 1 for d in shape[:-2]):
        raise ValueError(f"attention_mask: expected leading (batch / head) dims of size 1, got shape {shape}. The "
                         "varlen parameters describe one packed row: pass one [q, k] mask (all its sequences packed "
                         "along the diagonal), not a batch of masks.")
    m = attention_mask.reshape(shape[-2:])
    if m.numel() == 0:
        raise ValueError(f"attention_mask: expected a non-empty [q, k] mask, got shape {shape}. A row with no "
                         "tokens has no varlen parameters: skip it.")
    if m.dtype == torch.bool:
        return m
    if m.is_complex():
        raise TypeError(f"attention_mask: expected a bool, integer or real float mask, got {m.dtype}.")
    if not m.is_floating_point():
        if bool((m < 0).any()):
            raise ValueError("attention_mask: expected an integer mask of 0 (masked) / nonzero (attend), got "
                             f"negative values (min {int(m.min())}). Pass a bool mask, or a float additive mask.")
        return m != 0
    if bool(torch.isnan(m).any()):
        raise ValueError("attention_mask: expected no NaN, got NaN entries. Pass a bool mask.")
    if bool((m < 0).any()) or not bool(m.any()):  # additive: 0 = attend, -inf / large negative = masked
        masked = m <= ADDITIVE_MASKED_AT_MOST
        bad = ~(masked | (m == 0))
        if bool(bad.any()):
            qi, ki = (int(x) for x in bad.nonzero()[0])
            raise ValueError(f"attention_mask: read as an additive float mask (it has negative values), so expected "
                             f"every entry to be 0 (attend) or -inf / <= {ADDITIVE_MASKED_AT_MOST:g} (masked), got "
                             f"{float(m[qi, ki])!r} at (query {qi}, key {ki}). A soft bias has no cu_seqlens; pass a "
                             "bool mask (True = attend).")
        return ~masked
    bad = ~((m == 0) | (m == 1))
    if bool(bad.any()):
        qi, ki = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"attention_mask: read as a multiplicative float mask (no negative values), so expected every "
                         f"entry to be 0 (masked) or 1 (attend), got {float(m[qi, ki])!r} at (query {qi}, key {ki}). "
                         "Pass a bool mask (True = attend).")
    return m != 0


def flash_params_from_attention_mask(attention_mask: torch.Tensor,
                                     device: Optional[Union[torch.device, str]] = None) -> dict:
    """flash-attn varlen parameters of a block-causal self-attention mask.

    Args:
        attention_mask: ``[q, k]`` (or ``[1, q, k]``, ``[1, 1, q, k]``) bool / integer / float mask (see the module
            docstring for the values) whose attended entries form causal blocks along the diagonal. Block ``b``
            covers queries ``[cu_q[b], cu_q[b+1])`` and keys ``[cu_k[b], cu_k[b+1])`` with ``k_len >= q_len >= 1``;
            its query ``i`` (0-based inside the block) attends its keys ``j <= i + k_len - q_len``. For ``q == k``
            every block is square. Example: three sequences of 5, 3 and 4 tokens are a ``12 x 12`` mask with
            ``cu_seqlens [0, 5, 8, 12]``.
        device: where the ``cu_seqlens`` go (default: the mask's device).

    Returns:
        ``{"cu_seqlens_q": [n+1] int32, "cu_seqlens_k": [n+1] int32, "max_seqlen_q": int, "max_seqlen_k": int,
        "num_sequences": int}``.

    Raises:
        TypeError: not a tensor, or a complex dtype.
        ValueError: wrong ndim, leading dims != 1, empty, values that are neither a 0/1 nor an additive mask, or a
            mask that is not exactly block-causal (the message gives the first offending (query, key) entry).

    Vectorised: no Python loop over tokens; one host sync for the returned ints (more only on error).
    """
    a = _attend_of(attention_mask)
    Q, K = a.shape
    dev = a.device
    qi = torch.arange(Q, device=dev)
    # A valid block-causal mask: every query attends a contiguous key run that starts at its block's first key and
    # ends at its causal limit. A block starts where the first attended key changes from the previous query's.
    first = a.to(torch.uint8).argmax(1)  # first attended key per query (0 for a query attending nothing)
    is_start = torch.ones(Q, dtype=torch.bool, device=dev)
    is_start[1:] = first[1:] != first[:-1]
    # Per query: its block's query start / end and key start / end, without knowing the number of blocks yet.
    qs = torch.cummax(torch.where(is_start, qi, 0), 0).values
    nxt = torch.where(is_start, qi, Q)  # next block start at or after each query ...
    qe = torch.flip(torch.cummin(torch.flip(torch.cat([nxt[1:], nxt.new_full((1,), Q)]), [0]), 0).values, [0])
    ks = first[qs]
    ke = torch.where(qe < Q, first[qe.clamp(max=Q - 1)], K)  # a block's keys end where the next block's begin
    shift = (ke - ks) - (qe - qs)  # k_len - q_len: the bottom-right alignment of each query's block
    last = ks + (qi - qs) + shift  # last attended key of each query
    kj = torch.arange(K, device=dev)
    expected = (kj[None, :] >= ks[:, None]) & (kj[None, :] <= last[:, None])
    wrong = a != expected
    blind = ~a.any(1)  # queries attending nothing: no flash-attn block has them
    blocks_ok = (first[0] == 0) & (shift >= 0).all()
    checks = torch.stack([is_start.sum(), blind.any().long(), blocks_ok.long(), wrong.any().long(),
                          (qe - qs).max(), (ke - ks).max()])
    n, any_blind, blocks_ok, any_wrong, max_q, max_k = (int(x) for x in checks.tolist())  # the only sync on success
    if any_blind:
        i = int(blind.nonzero()[0, 0])
        raise ValueError(f"attention_mask: expected every query to attend at least one key (in a block-causal mask "
                         f"each query sees its block's first key), got query {i} attending none. {_FIX}")
    if not blocks_ok:
        _raise_blocks(a, first, qs, qe, ks, ke, shift)
    if any_wrong:
        pos = wrong.flatten().nonzero()[0, 0]
        q0, k0 = divmod(int(pos), K)
        b0 = int((torch.arange(Q, device=dev)[is_start] <= q0).sum()) - 1
        got = "attends" if bool(a[q0, k0]) else "does not attend"
        want = "attend" if bool(expected[q0, k0]) else "not attend"
        raise ValueError(
            f"attention_mask: expected a block-causal mask (queries [{int(qs[q0])}, {int(qe[q0])}) x keys "
            f"[{int(ks[q0])}, {int(ke[q0])}) form block {b0}, where query {q0} should attend keys "
            f"{int(ks[q0])}..{int(last[q0])}), got query {q0} that {got} key {k0} (it should {want} it). A hole "
            f"inside a block, an attended key outside the diagonal blocks or above the causal limit, and keys no query "
            f"attends (a block without queries: ambiguous) all land here. "
            f"{_FIX}")
    starts = torch.argsort((~is_start).to(torch.uint8), stable=True)[:n]  # the block starts, in order (no sync)
    cu_q = torch.cat([starts, starts.new_full((1,), Q)]).to(torch.int32)
    cu_k = torch.cat([first[starts], first.new_full((1,), K)]).to(torch.int32)
    return _params(cu_q, cu_k, max_q, max_k, device)


def _raise_blocks(a, first, qs, qe, ks, ke, shift) -> None:
    """The error for a block structure no flash-attn call can express (error path: syncs freely)."""
    Q, K = a.shape
    if int(first[0]) != 0:
        raise ValueError(f"attention_mask: expected query 0 to attend key 0 (the first block starts at (0, 0); keys "
                         f"no query attends cannot be placed in a block), got query 0's first attended key "
                         f"{int(first[0])}. {_FIX}")
    i = int((shift < 0).nonzero()[0, 0])
    if int(ke[i]) <= int(ks[i]):
        raise ValueError(
            f"attention_mask: expected the blocks to move down-right along the diagonal (each block's first key after "
            f"the previous block's), got queries [{int(qs[i])}, {int(qe[i])}) starting at key {int(ks[i])} and the "
            f"next queries starting at key {int(ke[i])}. {_FIX}")
    raise ValueError(
        f"attention_mask: expected every block to have at least as many keys as queries (k_len >= q_len, "
        f"bottom-right causal), got the block of queries [{int(qs[i])}, {int(qe[i])}) with keys [{int(ks[i])}, "
        f"{int(ke[i])}) ({int(qe[i] - qs[i])} queries, {int(ke[i] - ks[i])} keys) in a [{Q}, {K}] mask. A query whose "
        f"first attended key is not its block's first key lands here too. {_FIX}")


def flash_params_from_padding_mask(padding_mask: torch.Tensor,
                                   device: Optional[Union[torch.device, str]] = None) -> dict:
    """flash-attn varlen parameters of a padded batch's valid tokens (self-attention, one sequence per row).

    Args:
        padding_mask: ``[n, L]`` bool / 0-1 int / float; nonzero = valid. Row ``b``'s valid-token count is sequence
            ``b``'s length (where in the row the valid tokens sit does not matter).
        device: where the ``cu_seqlens`` go (default: the mask's device).

    Returns:
        ``cu_seqlens_q == cu_seqlens_k [n+1] int32`` (two tensors), ``max_seqlen_q == max_seqlen_k`` (0 for
        ``n == 0``) and ``num_sequences = n`` (Python ints).
    """
    if not isinstance(padding_mask, torch.Tensor):
        raise TypeError(f"padding_mask: expected a torch.Tensor [n, L], got {type(padding_mask).__name__}.")
    if padding_mask.dim() != 2:
        raise ValueError(f"padding_mask: expected a 2-D [n, L] tensor (one sequence per row), got shape "
                         f"{tuple(padding_mask.shape)}. For a [q, k] self-attention mask use "
                         "flash_params_from_attention_mask.")
    lens = (padding_mask != 0).sum(1).to(torch.int32)
    cu = torch.zeros(lens.numel() + 1, dtype=torch.int32, device=lens.device)
    cu[1:] = torch.cumsum(lens, 0)
    max_len = int(lens.max()) if lens.numel() else 0
    return _params(cu, cu.clone(), max_len, max_len, device)
