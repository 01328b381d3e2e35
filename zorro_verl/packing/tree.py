"""The prefix-tree plan: rows share every common prefix, not only identical prompts (docs/design/math.md, attention.md).

Each row's valid tokens (prompt and response, including tokens masked out of the loss) are one sequence; the
sequences form a trie. Each kept trie edge is one **node**: a segment of the packed row computed once. A node's
queries attend to all keys of its ancestor nodes and causally to its own; its positions continue from its
ancestors (``node_pos0`` = tokens above it). Nodes are laid out in DFS pre-order, so a node's subtree is the
contiguous packed range ``[node_start, node_sub_end)``::

    rows (valid tokens):   row 0: S S S q1 q1 | a a      row 1: S S S q1 q1 | b       row 2: S S S q2 | c c
    trie (min_shared=2):   n0 = S S S  ->  n1 = q1 q1 -> n2 = a a
                                                      -> n3 = b
                                       ->  n4 = q2 c c
    packed row:            [S S S | q1 q1 | a a | b | q2 c c]
    pos:                    0 1 2   3  4    5 6   5   3  4 5

**Construction** (vectorised on device, the trie on the host over ``B`` ints): the sequences are sorted
lexicographically (``torch.unique`` over rows padded with ``-1``, which sorts a prefix before its extensions); the
longest common prefix (LCP) of sorted neighbours gives the compacted trie as nested LCP intervals (an interval of
sorted rows whose LCPs are all ``>= d`` shares ``d`` tokens). One host read of the checks and the neighbour LCPs
builds the ``O(B)``-node trie in Python; every token-level index is then built on the device.

**Minimum shared length.** An interval's shared part becomes a node only if it adds at least ``min_shared_len``
tokens over its kept parent (``DEFAULT_MIN_SHARED_LEN``): a tiny common prefix such as a chat-template header is
then recomputed per child instead of fragmenting the batch into short segments. Rows with identical prompts always
share their whole prompt (the prompt plan's grouping, whatever its length): a short node ending at that prompt is
kept. So the prompt plan is the depth-one special case: with nothing shared beyond identical prompts the trie is
``prompt -> responses``.

**Outputs.** ``logit_index [N]`` (original row order) points at the packed token predicting each response token;
a token shared by several rows is one packed position, so the LM head runs on ``head_index [Nh]`` (the distinct
positions) and ``head_inverse [N]`` maps each output to its head row, with the row's own ``target_ids``.

Imports torch only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PrefixTree", "DEFAULT_MIN_SHARED_LEN", "SHARING_MODES", "check_sharing",
           "check_min_shared_len", "path_index", "sorted_sequences", "trie_nodes", "child_buckets"]

#: Values of ``sharing``: ``prompt`` (rows with identical prompts share them) and ``prefix`` (the prefix tree).
SHARING_MODES = ("prompt", "prefix")
#: Tokens a shared node must add over its parent to be kept: longer than chat-template headers (~20-40 tokens with
#: Qwen's template), far shorter than the system prompts / tool specifications / earlier turns worth sharing.
DEFAULT_MIN_SHARED_LEN = 64


def check_sharing(value) -> str:
    """``value`` if it is one of :data:`SHARING_MODES`, else a ``ValueError`` naming the choices."""
    if value not in SHARING_MODES:
        raise ValueError(f"sharing: expected one of {SHARING_MODES}, got {value!r}. 'prompt' shares identical "
                         "prompts, 'prefix' every common prefix (prefix tree).")
    return value


def check_min_shared_len(value) -> int:
    """``value`` if it is an int >= 1, else a ``TypeError`` / ``ValueError`` naming the field."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"min_shared_len: expected an int >= 1, got {type(value).__name__}.")
    if value < 1:
        raise ValueError(f"min_shared_len: expected an int >= 1 (tokens a shared prefix-tree node must add), got "
                         f"{value}.")
    return value


@dataclass
class PrefixTree:
    """The trie of a prefix-tree plan (``plan.tree``). ``M`` nodes in DFS pre-order (= packed order).

    Python ints: ``M``, ``levels`` (max node depth + 1), ``num_roots``, ``num_children`` (non-root nodes),
    ``root_tokens``, ``child_tokens``, ``max_root_len``, ``max_child_len``, ``max_anc_len`` (longest ancestor chain
    of a non-root node), ``max_path_len`` (its ``pos0 + len``), ``kv_total`` (``sum`` of ``pos0 + len`` over non-root
    nodes: the keys of a per-node ``[ancestors ; itself]`` gather), ``level_counts`` (per depth ``d``: ``(nodes with
    descendants, their tokens, their descendants' tokens, the longest such node, the largest such subtree below a
    node)``), ``level_sizes`` (per depth ``d``: ``(nodes, the longest node)``), ``child_buckets`` (the dense
    backends' blocks of non-root nodes: per block ``(nodes, longest node, longest ancestor chain)``, see
    :func:`child_buckets`).

    Tensors (int64, the batch's device): ``node_start [M]`` (packed offset), ``node_len [M]``, ``node_pos0 [M]``
    (position of its first token = tokens of its ancestors), ``node_parent [M]`` (-1 for roots), ``node_depth [M]``,
    ``node_sub_end [M]`` (packed end of its subtree), ``node_anc [M, levels]`` (its ancestor at each depth,
    itself at its own depth, -1 below), ``node_rep_row [M]`` (a row passing through it), ``roots [num_roots]``,
    ``children [num_children]`` (node ids, packed order), ``child_order [num_children]`` (positions into
    ``children``, block by block of ``child_buckets``), ``row_node [B]`` (the node holding each row's last token),
    ``token_node [T]``.
    """

    M: int
    levels: int
    num_roots: int
    num_children: int
    root_tokens: int
    child_tokens: int
    max_root_len: int
    max_child_len: int
    max_anc_len: int
    max_path_len: int
    kv_total: int
    level_counts: tuple
    level_sizes: tuple
    child_buckets: tuple
    node_start: torch.Tensor
    node_len: torch.Tensor
    node_pos0: torch.Tensor
    node_parent: torch.Tensor
    node_depth: torch.Tensor
    node_sub_end: torch.Tensor
    node_anc: torch.Tensor
    node_rep_row: torch.Tensor
    roots: torch.Tensor
    children: torch.Tensor
    child_order: torch.Tensor
    row_node: torch.Tensor
    token_node: torch.Tensor


def path_index(tree: PrefixTree, nodes: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """Packed index of the token at string depth ``depth`` on the root path of ``nodes``.

    ``nodes [n] int64``, ``depth [n, k] int64`` (each ``< node_pos0 + node_len`` of its node) -> ``[n, k] int64``.
    The path's nodes tile ``[0, pos0 + len)``: the token lies in the deepest ancestor starting at or before it."""
    anc = tree.node_anc[nodes]  # [n, levels]
    big = torch.iinfo(torch.long).max
    pos0 = torch.where(anc >= 0, tree.node_pos0[anc.clamp(min=0)], big)  # [n, levels]
    lvl = (pos0[:, None, :] <= depth[:, :, None]).sum(-1) - 1  # [n, k]
    node = anc.gather(1, lvl.clamp(min=0))  # [n, k]
    return tree.node_start[node] + depth - tree.node_pos0[node]


# ---------------------------------------------------------------------------------------------------- building
#: :func:`child_buckets`: at most this many blocks, each costing this many (query, key) pairs more than its pairs
#: (a dense call's fixed cost on 2 CPU cores is about that many pairs' worth of work).
MAX_CHILD_BUCKETS = 4
BUCKET_CALL_PAIRS = 32768
_BUCKET_CANDIDATES = 32


def child_buckets(lens: list, ancs: list, max_buckets: int = MAX_CHILD_BUCKETS,
                  call_pairs: int = BUCKET_CALL_PAIRS) -> tuple[list, tuple]:
    """Split a tree's non-root nodes into the padded blocks of the dense backends (host ints, no device work).

    A dense backend pads every node of a block to the block's longest node (queries) and its keys to the longest
    ancestor chain plus that length: a block of ``n`` nodes costs ``n * Lq * (A + Lq)`` (query, key) pairs. One
    block over a batch whose non-root nodes are a few short questions and many long responses pads each question
    to a response's length; blocks of similar lengths do not. Nodes are sorted by length and cut into at most
    ``max_buckets`` runs minimising ``sum of pairs + call_pairs per block`` (dynamic programming over at most
    :data:`_BUCKET_CANDIDATES` cut points where the length changes).

    ``lens [C]``, ``ancs [C]``: each non-root node's length and ancestor-chain length (``node_pos0``). Returns
    ``(order, buckets)``: ``order [C]`` positions into the inputs, bucket by bucket; ``buckets``: per block
    ``(nodes, longest node, longest chain)``. Empty inputs give ``([], ())``."""
    C = len(lens)
    if C == 0:
        return [], ()
    order = sorted(range(C), key=lambda j: (lens[j], ancs[j]))
    cuts = [i for i in range(1, C) if lens[order[i]] != lens[order[i - 1]]]
    if len(cuts) > _BUCKET_CANDIDATES - 1:  # evenly spaced among the length changes
        step = len(cuts) / (_BUCKET_CANDIDATES - 1)
        cuts = sorted({cuts[int(k * step)] for k in range(_BUCKET_CANDIDATES - 1)})
    pts = [0] + cuts + [C]
    K = len(pts) - 1
    seg_anc = [max(ancs[order[i]] for i in range(pts[k], pts[k + 1])) for k in range(K)]  # per elementary run

    def cost(a: int, b: int, anc: int) -> int:  # runs a..b-1 as one block; anc = their longest chain
        lq = lens[order[pts[b] - 1]]
        return (pts[b] - pts[a]) * lq * (anc + lq) + call_pairs

    inf = float("inf")
    best = [[inf] * (K + 1) for _ in range(max_buckets + 1)]  # best[m][b]: runs 0..b-1 in m blocks
    back = [[0] * (K + 1) for _ in range(max_buckets + 1)]
    best[0][0] = 0
    for m in range(1, max_buckets + 1):
        for b in range(1, K + 1):
            anc = 0
            for a in range(b - 1, -1, -1):  # block = runs a..b-1, grown leftwards
                anc = max(anc, seg_anc[a])
                c = best[m - 1][a] + cost(a, b, anc)
                if c < best[m][b]:
                    best[m][b], back[m][b] = c, a
    m = min(range(1, max_buckets + 1), key=lambda k: best[k][K])
    bounds, b = [], K
    while m > 0:
        a = back[m][b]
        bounds.append((pts[a], pts[b]))
        b, m = a, m - 1
    buckets = tuple((e - s, lens[order[e - 1]], max(ancs[order[i]] for i in range(s, e)))
                    for s, e in reversed(bounds))
    return order, buckets


def sorted_sequences(input_ids: torch.Tensor, am: torch.Tensor, Pw: int):
    """Rows as left-aligned sequences, sorted. ``input_ids [B, S]``, ``am [B, S] bool`` ->
    ``(inverse [B] (row -> sorted unique sequence), lengths [U], lcp [U-1] (of sorted neighbours), first_row [U])``,
    all int64 on the device."""
    B, S = input_ids.shape
    dev = input_ids.device
    p_len = am[:, :Pw].sum(1)
    L = am.sum(1)
    ar = torch.arange(S, device=dev)
    cols = (Pw - p_len[:, None] + ar[None, :]).clamp(max=S - 1)  # [B, S]: the verl layout is contiguous over valid
    seq = torch.where(ar[None, :] < L[:, None], input_ids.gather(1, cols), -1)  # [B, S], -1 after the end
    uniq, inv = torch.unique(seq, dim=0, return_inverse=True)  # lexicographic; -1 sorts a prefix first
    U = uniq.shape[0]
    ar_b = torch.arange(B, device=dev)
    first = torch.full((U,), B, dtype=torch.long, device=dev).scatter_reduce(0, inv, ar_b, "amin")
    lens = (uniq >= 0).sum(1)
    # distinct rows always differ within S columns (a shorter one has -1 where the other has a token)
    lcp = (uniq[1:] != uniq[:-1]).int().argmax(1) if U > 1 else torch.zeros(0, dtype=torch.long, device=dev)
    return inv, lens, lcp.long(), first


def trie_nodes(lcp: list, lens: list, prompt_lens: list, min_shared_len: int):
    """The compacted, pruned trie over ``U`` sorted sequences (host side, ``O(U * levels)``).

    ``lcp [U-1]``: LCP of sorted neighbours; ``lens [U]``; ``prompt_lens [U]``: the set of prompt lengths of the
    rows holding each sequence. An interval of sorted sequences sharing ``d`` tokens becomes a node
    ``[a, d)`` (``a`` = its kept parent's end) if ``d - a >= min_shared_len``; otherwise, if two of its sequences
    have identical prompts (the same prompt length ``a < p <= d``: the first ``d`` tokens are common), a node
    ``[a, p)`` is cut at the shortest such prompt and the interval is looked at again from ``p``; otherwise its
    children recompute ``[a, d)``. Chains of only children are then merged into one node (:func:`_merge_chains`).

    Returns ``(nodes, end_node)``: ``nodes`` in DFS pre-order as ``[pos0, length, parent, depth, rep_seq]`` lists
    and ``end_node [U]`` (the node holding each sequence's last token)."""
    U = len(lens)
    nodes: list = []
    end_node = [-1] * U
    stack = [(0, U - 1, 0, -1, 0)]  # (lo, hi, kept depth a, parent node, node depth)
    while stack:
        lo, hi, a, parent, depth = stack.pop()
        if lo == hi:
            if lens[lo] > a:
                nodes.append([a, lens[lo] - a, parent, depth, lo])
                end_node[lo] = len(nodes) - 1
            else:  # the sequence ends where its kept parent ends (a prefix of its siblings)
                end_node[lo] = parent
            continue
        d = min(lcp[lo:hi])
        if d - a >= min_shared_len:
            cut = d
        else:  # identical prompts are always shared (the prompt plan's groups), however short
            seen: set = set()
            forced = [p for u in range(lo, hi + 1) for p in prompt_lens[u] if a < p <= d and (p in seen or seen.add(p))]
            cut = min(forced) if forced else None
        if cut is not None and cut < d:  # a prompt node; the rest of the interval is looked at again from there
            nodes.append([a, cut - a, parent, depth, lo])
            stack.append((lo, hi, cut, len(nodes) - 1, depth + 1))
            continue
        if cut is not None:
            nodes.append([a, cut - a, parent, depth, lo])
            a, parent, depth = cut, len(nodes) - 1, depth + 1
        bounds = [k for k in range(lo, hi) if lcp[k] == d]
        edges = [lo] + [k + 1 for k in bounds] + [hi + 1]
        for s, e in reversed(list(zip(edges[:-1], edges[1:]))):  # reversed: the stack pops them in order
            stack.append((s, e - 1, a, parent, depth))
    return _merge_chains(nodes, end_node)


def _merge_chains(nodes: list, end_node: list):
    """Merge every node with its only child: rows need no node boundary where they end (a row that is a prefix of
    another reads its tokens on the longer row's path), so a chain of single children — a multi-turn trajectory
    stored as one sample per turn — is one segment, not one level per turn. DFS order is kept."""
    M = len(nodes)
    kids = [0] * M
    for n in nodes:
        if n[2] >= 0:
            kids[n[2]] += 1
    into = list(range(M))  # node -> the node it was merged into
    alive = [True] * M
    for i in range(M - 1, -1, -1):  # bottom-up, so a whole chain collapses into its top
        if kids[i] == 1:
            c = i + 1  # in DFS pre-order an only child follows its parent
            nodes[i][1] += nodes[c][1]
            nodes[i][4] = nodes[c][4]  # a sequence that passes through both
            kids[i] = kids[c]
            alive[c] = False
            into[c] = i
    for i in range(M):  # resolve merged chains to their surviving top
        j = i
        while into[j] != j:
            j = into[j]
        into[i] = j
    new_id = {}
    out = []
    for i in range(M):
        if alive[i]:
            new_id[i] = len(out)
            n = list(nodes[i])
            n[2] = new_id[into[n[2]]] if n[2] >= 0 else -1
            n[3] = out[n[2]][3] + 1 if n[2] >= 0 else 0
            out.append(n)
    return out, [new_id[into[e]] for e in end_node]


def tree_chains(plan) -> dict:
    """The ancestor chains of a tree plan's non-root nodes (memoised under ``"tree_chains"``; no host sync).

    * ``chain [C, A] int64``: packed index of each chain token (the ancestors' tokens, root first; 0 on pads),
      ``chain_valid [C, A] bool``, where ``C = num_children``, ``A = max_anc_len``;
    * ``kv_index [kv_total]``: per child ``[its chain ; itself]`` concatenated (the gather design's keys);
    * ``root_tokens [root_tokens]``, ``child_tokens [child_tokens]``: packed indices of root / non-root tokens.
    """
    tree: PrefixTree = plan.tree

    def build():
        from zorro_verl.packing.segments import segments_to_tokens

        dev = plan.device
        kids = tree.children
        A = tree.max_anc_len
        pos0 = tree.node_pos0[kids]  # [C]
        ar = torch.arange(A, device=dev)[None, :]
        valid = ar < pos0[:, None]  # [C, A]
        chain = path_index(tree, kids, torch.minimum(ar, (pos0 - 1).clamp(min=0)[:, None]).expand(kids.numel(), A))
        anc = tree.node_anc[kids]  # [C, levels]: the chain's nodes then itself, -1 after
        lens = torch.where(anc >= 0, tree.node_len[anc.clamp(min=0)], 0)
        kv_index = segments_to_tokens(tree.node_start[anc.clamp(min=0)].flatten(), lens.flatten(), tree.kv_total)
        return {
            "chain": torch.where(valid, chain, 0), "chain_valid": valid, "kv_index": kv_index,
            "root_tokens": segments_to_tokens(tree.node_start[tree.roots], tree.node_len[tree.roots],
                                              tree.root_tokens),
            "child_tokens": segments_to_tokens(tree.node_start[kids], tree.node_len[kids], tree.child_tokens),
        }

    return plan.memo.get("tree_chains", build)


def tree_row_costs(input_ids: torch.Tensor, attention_mask: torch.Tensor, response_width: int,
                   min_shared_len: int = DEFAULT_MIN_SHARED_LEN) -> dict:
    """Per-row costs of the prefix tree for micro-batching and DP balancing (one host read; the trie the plan of
    these rows would build). Rows of one **cluster** (trie root) share at least its root; inside a cluster, each
    node is paid by the first row (in sorted order) that passes through it.

    ``input_ids [B, S]``, ``attention_mask [B, S]`` (verl layout) -> host lists ``[B]``: ``cluster`` (ids by first
    appearance), ``root_len`` (its cluster root's tokens), ``own`` (tokens of the nodes below the root this row pays:
    ``root + sum(own)`` over a whole cluster is the tree's token count), ``below_root`` (``max(0, p + r -
    root_len)``, what a row costs in a piece of a cut cluster, where inner nodes may be paid again: conservative),
    with one exception: a root shorter than ``min_shared_len`` (kept only for identical prompts, which a piece may
    lack) reports ``root_len`` 0, is paid in the ``own`` of the cluster's first row, and ``below_root`` is then the
    row's whole ``p + r``,
    ``length`` (``p + r``).
    """
    check_min_shared_len(min_shared_len)
    B, S = input_ids.shape
    Pw = S - response_width
    am = attention_mask != 0
    p_len = am[:, :Pw].sum(1)
    inv, lens, lcp, first = sorted_sequences(input_ids.long(), am, Pw)
    U = lens.numel()
    host = torch.cat([lens, lcp, inv, p_len, first]).tolist()
    lens_h, lcp_h = host[:U], host[U:2 * U - 1]
    inv_h, pl_h, first_h = host[2 * U - 1:2 * U - 1 + B], host[2 * U - 1 + B:2 * U - 1 + 2 * B], host[-U:]
    plens: list = [set() for _ in range(U)]
    for u, pl in zip(inv_h, pl_h):
        plens[u].add(pl)
    nodes, end_node = trie_nodes(lcp_h, lens_h, plens, min_shared_len)
    root = [0] * len(nodes)
    for i, n in enumerate(nodes):
        root[i] = i if n[2] < 0 else root[n[2]]
    own_seq = [0] * U  # tokens of non-root nodes first reached by sequence u (the interval's first sequence)
    for n in nodes:
        if n[2] >= 0:
            own_seq[n[4]] += n[1]
    cluster_of_root: dict = {}
    cluster, root_len, own, below, length = [], [], [], [], []
    paid: set = set()
    for b in range(B):
        u = inv_h[b]
        r = root[end_node[u]]
        cluster.append(cluster_of_root.setdefault(r, len(cluster_of_root)))
        root_len.append(nodes[r][1])
        own.append(own_seq[u] if u not in paid and first_h[u] == b else 0)  # identical rows: paid once
        paid.add(u)
        length.append(lens_h[u])
        below.append(max(0, lens_h[u] - nodes[r][1]))  # a row may end inside its root (a merged chain)
    # A root shorter than min_shared_len was kept only because some rows have identical prompts: a piece of a cut
    # cluster without those rows recomputes it per branch. Such a cluster pays its root through its first row
    # instead (the whole cluster's cost is unchanged) and a row in a piece pays its whole sequence.
    first_of: dict = {}
    for b in range(B):
        if root_len[b] < min_shared_len:
            if first_of.setdefault(cluster[b], b) == b:
                own[b] += root_len[b]
            below[b] = length[b]
            root_len[b] = 0
    return {"cluster": cluster, "root_len": root_len, "own": own, "below_root": below, "length": length}
