"""Pairwise (strength-2) covering arrays for configuration matrices, generated deterministically by a greedy,
AETG-style construction (pure Python, no randomness).

A *factor* is an option with a list of levels (``{"sp": [1, 2], ...}``); a *pair* is two factors at one level each.
:func:`pairwise` returns rows (dicts factor -> level) such that every allowed pair occurs in some row:

* ``forbidden``: pairs that are real impossibilities (no row may hold one; they need no coverage);
* ``refused``: pairs the code under test refuses by design: the main rows hold none of them (a refused pair would
  stop its row, and the row's other pairs would then go untested), and each gets one extra row of its own (the pair,
  every other factor at its first level that forms no forbidden / refused pair), returned separately so the caller
  can expect the refusal there.

Greedy step (until every allowed pair is covered): the row starts from the first uncovered pair (factors in the
given order, levels in the given order), then each other factor, most levels first, takes the level that covers the
most still-uncovered pairs with the factors already set (ties: the earlier level), among the levels that form no
forbidden / refused pair with them. :func:`uncovered` checks a result.
"""

from __future__ import annotations

from itertools import combinations

__all__ = ["pairwise", "all_pairs", "uncovered", "row_pairs"]


def _key(f1, v1, f2, v2, order):
    """A pair as a canonical tuple (the factor earlier in ``order`` first)."""
    return (f1, v1, f2, v2) if order[f1] < order[f2] else (f2, v2, f1, v1)


def all_pairs(factors: dict) -> list:
    """Every pair of ``factors`` (``{name: [levels]}``) as ``(f1, v1, f2, v2)`` with ``f1`` before ``f2``."""
    names = list(factors)
    return [(a, va, b, vb) for a, b in combinations(names, 2) for va in factors[a] for vb in factors[b]]


def row_pairs(row: dict, factors: dict) -> set:
    """The pairs one row holds."""
    order = {f: i for i, f in enumerate(factors)}
    return {_key(a, row[a], b, row[b], order) for a, b in combinations(factors, 2)}


def _canon(pairs, factors):
    order = {f: i for i, f in enumerate(factors)}
    out = set()
    for (a, va), (b, vb) in pairs:
        if a not in factors or b not in factors or a == b or va not in factors[a] or vb not in factors[b]:
            raise ValueError(f"constraint pair {((a, va), (b, vb))}: expected two different factors at one of "
                             "their levels each")
        out.add(_key(a, va, b, vb, order))
    return out


def _compatible(row: dict, f, v, banned: set, order: dict) -> bool:
    return all(_key(f, v, g, w, order) not in banned for g, w in row.items() if g != f)


def _complete(row: dict, factors: dict, banned: set, uncovered_pairs: set, order: dict) -> dict:
    """Set the factors ``row`` lacks, most levels first, each to the compatible level covering most uncovered
    pairs (ties: the earlier level)."""
    rest = sorted((f for f in factors if f not in row), key=lambda f: (-len(factors[f]), order[f]))
    for f in rest:
        best, best_gain = None, -1
        for v in factors[f]:
            if not _compatible(row, f, v, banned, order):
                continue
            gain = sum(_key(f, v, g, w, order) in uncovered_pairs for g, w in row.items())
            if gain > best_gain:
                best, best_gain = v, gain
        if best is None:
            raise ValueError(f"no level of {f!r} fits the partial row {row} under the constraints")
        row[f] = best
    return {f: row[f] for f in factors}


def pairwise(factors: dict, forbidden=(), refused=()) -> tuple:
    """A strength-2 covering array of ``factors`` (``{name: [levels]}``, levels hashable).

    Args:
        factors: the options and their levels, in a fixed order (the result depends on it, deterministically).
        forbidden: pairs ``((f1, v1), (f2, v2))`` no row may hold (real impossibilities).
        refused: pairs ``((f1, v1), (f2, v2))`` expected to be refused: excluded from the main rows, one extra row
            each.

    Returns:
        ``(rows, refusal_rows)``: ``rows`` cover every pair that is neither forbidden nor refused and hold neither;
        ``refusal_rows`` is a list of ``(pair, row)``, ``row`` holding ``pair`` and no forbidden pair (nor any other
        refused pair).
    """
    order = {f: i for i, f in enumerate(factors)}
    forbidden_set, refused_set = _canon(forbidden, factors), _canon(refused, factors)
    banned = forbidden_set | refused_set
    todo = {p for p in all_pairs(factors) if p not in banned}
    pending = sorted(todo, key=lambda p: (order[p[0]], order[p[2]], factors[p[0]].index(p[1]),
                                          factors[p[2]].index(p[3])))
    rows = []
    while todo:
        a, va, b, vb = next(p for p in pending if p in todo)
        row = _complete({a: va, b: vb}, factors, banned, todo, order)
        rows.append(row)
        todo -= row_pairs(row, factors)
    refusal_rows = []
    for a, va, b, vb in sorted(refused_set, key=lambda p: (order[p[0]], order[p[2]], factors[p[0]].index(p[1]),
                                                          factors[p[2]].index(p[3]))):
        others = banned - {(a, va, b, vb)}
        row = _complete({a: va, b: vb}, factors, others, set(), order)
        refusal_rows.append((((a, va), (b, vb)), row))
    return rows, refusal_rows


def uncovered(rows: list, factors: dict, forbidden=(), refused=()) -> set:
    """Allowed pairs (neither forbidden nor refused) that no row of ``rows`` holds."""
    banned = _canon(forbidden, factors) | _canon(refused, factors)
    held = set().union(*(row_pairs(r, factors) for r in rows)) if rows else set()
    return {p for p in all_pairs(factors) if p not in banned and p not in held}
