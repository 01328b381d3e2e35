"""Pairwise (strength-2) covering arrays with constraints, for the configuration-matrix tests (never shipped).

:func:`covering_array` returns a list of full assignments (one dict per test case) such that every *allowed* pair of
values of two factors occurs in at least one case and every case satisfies the constraints. It is deterministic (the
same factors and constraint give the same cases, in the same order): a greedy construction in the spirit of AETG
without its random restarts.

Constraints are one predicate ``allowed(partial) -> bool`` over **partial** assignments: it gets a dict holding some
of the factors and returns False only when the values given already violate a constraint (so a rule such as "``sp``
on needs ``tp = 2``" is written ``not (a.get("sp") and a.get("tp", 2) != 2)``). A pair is allowed when some full
assignment that satisfies the constraints contains it (found by a backtracking search that prunes with the
predicate), so pairs excluded only through a chain of constraints are recognised too.

:func:`pairwise` is the same construction for constraints given as lists of value pairs (the FSDP matrix):

* ``forbidden``: pairs that are real impossibilities (no row may hold one; they need no coverage);
* ``refused``: pairs the code under test refuses by design: the main rows hold none of them (a refused pair would
  stop its row, and the row's other pairs would then go untested), and each gets one extra row of its own (the pair,
  every other factor at its first level that forms no forbidden / refused pair), returned separately so the caller
  can expect the refusal there.
"""

from __future__ import annotations

from itertools import combinations
from typing import Callable

__all__ = ["covering_array", "allowed_pairs", "uncovered_pairs", "pairwise", "all_pairs", "uncovered", "row_pairs"]

Pair = tuple  # (factor_a, value_index_a, factor_b, value_index_b), factor_a before factor_b in the factors' order


def _completable(factors: dict, allowed: Callable[[dict], bool], partial: dict) -> dict | None:
    """A full assignment extending ``partial`` that ``allowed`` accepts at every step, or None (depth-first, values in
    the factors' order: deterministic)."""
    if not allowed(dict(partial)):
        return None
    for name, values in factors.items():
        if name not in partial:
            for v in values:
                full = _completable(factors, allowed, {**partial, name: v})
                if full is not None:
                    return full
            return None
    return dict(partial)


def _pairs_of(factors: dict, case: dict) -> set:
    names = list(factors)
    idx = {n: factors[n].index(case[n]) for n in names}
    return {(a, idx[a], b, idx[b]) for a, b in combinations(names, 2)}


def allowed_pairs(factors: dict, allowed: Callable[[dict], bool]) -> set:
    """Every pair ``(factor_a, index_a, factor_b, index_b)`` (value indices into ``factors``) that some full
    assignment satisfying ``allowed`` contains."""
    out = set()
    for a, b in combinations(list(factors), 2):
        for i, va in enumerate(factors[a]):
            for j, vb in enumerate(factors[b]):
                if _completable(factors, allowed, {a: va, b: vb}) is not None:
                    out.add((a, i, b, j))
    return out


def uncovered_pairs(factors: dict, allowed: Callable[[dict], bool], cases: list) -> set:
    """The allowed pairs that no case of ``cases`` contains (empty for a covering array)."""
    covered = set().union(*(_pairs_of(factors, c) for c in cases)) if cases else set()
    return allowed_pairs(factors, allowed) - covered


def _grow(factors: dict, allowed: Callable[[dict], bool], seed: Pair, todo: set) -> dict:
    """One case: the seed pair's two values, then factor by factor (in order) the value that covers the most pairs of
    ``todo`` with the values chosen so far and can still be completed (ties: the first value)."""
    a, i, b, j = seed
    case = {a: factors[a][i], b: factors[b][j]}
    for name, values in factors.items():
        if name in case:
            continue
        best, best_gain = None, -1
        for k, v in enumerate(values):
            trial = {**case, name: v}
            if _completable(factors, allowed, trial) is None:
                continue
            gain = 0
            for other, ov in case.items():
                oi = factors[other].index(ov)
                key = (other, oi, name, k) if list(factors).index(other) < list(factors).index(name) \
                    else (name, k, other, oi)
                gain += key in todo
            if gain > best_gain:
                best, best_gain = v, gain
        case[name] = best
    return {n: case[n] for n in factors}


def covering_array(factors: dict[str, list], allowed: Callable[[dict], bool] = lambda a: True,
                   candidates: int = 64) -> list[dict]:
    """A strength-2 covering array of ``factors`` (``{name: [values]}``, each value list without duplicates) under
    the constraint predicate ``allowed`` (see the module docstring): a list of full assignments ``{name: value}``
    covering every allowed pair at least once, each satisfying ``allowed``. Greedy: each new case is grown from each
    of the first ``candidates`` uncovered pairs (in the factors' order) and the one covering the most uncovered pairs
    is kept (ties: the earliest seed). Deterministic."""
    for name, values in factors.items():
        if len(set(map(repr, values))) != len(values) or not values:
            raise ValueError(f"factor {name!r}: expected distinct values, got {values!r}")
    order = {(a, i, b, j): n for n, (a, i, b, j) in enumerate(
        (a, i, b, j) for a, b in combinations(list(factors), 2)
        for i in range(len(factors[a])) for j in range(len(factors[b])))}
    todo = allowed_pairs(factors, allowed)
    cases = []
    while todo:
        best, best_new = None, set()
        for seed in sorted(todo, key=order.__getitem__)[:candidates]:
            case = _grow(factors, allowed, seed, todo)
            new = _pairs_of(factors, case) & todo
            if len(new) > len(best_new):
                best, best_new = case, new
        assert best_new  # a seed pair is allowed, so its case covers at least the seed
        cases.append(best)
        todo -= best_new
    return cases


# ------------------------------------------------------------------------------------- constraints as pair lists
def _key(f1, v1, f2, v2, order):
    """A pair as a canonical tuple (the factor earlier in ``order`` first)."""
    return (f1, v1, f2, v2) if order[f1] < order[f2] else (f2, v2, f1, v1)


def all_pairs(factors: dict) -> list:
    """Every pair of ``factors`` (``{name: [levels]}``) as ``(f1, v1, f2, v2)`` with ``f1`` before ``f2``."""
    names = list(factors)
    return [(a, va, b, vb) for a, b in combinations(names, 2) for va in factors[a] for vb in factors[b]]


def row_pairs(row: dict, factors: dict) -> set:
    """The pairs one row holds, as ``(f1, v1, f2, v2)``."""
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


def _avoiding(factors: dict, banned: set) -> Callable[[dict], bool]:
    """The predicate of :func:`covering_array` that rejects a partial assignment holding a pair of ``banned``."""
    order = {f: i for i, f in enumerate(factors)}
    return lambda a: not any(_key(f, a[f], g, a[g], order) in banned for f, g in combinations(a, 2))


def pairwise(factors: dict, forbidden=(), refused=()) -> tuple:
    """A strength-2 covering array of ``factors`` (``{name: [levels]}``, levels hashable) avoiding pair lists.

    Args:
        factors: the options and their levels, in a fixed order (the result depends on it, deterministically).
        forbidden: pairs ``((f1, v1), (f2, v2))`` no row may hold (real impossibilities).
        refused: pairs ``((f1, v1), (f2, v2))`` expected to be refused: excluded from the main rows, one extra row
            each.

    Returns:
        ``(rows, refusal_rows)``: ``rows`` (:func:`covering_array` under both lists) cover every pair that is neither
        forbidden nor refused and hold neither; ``refusal_rows`` is a list of ``(pair, row)``, ``row`` holding
        ``pair`` and no forbidden pair (nor any other refused pair), every other factor at its first level that
        allows it.
    """
    order = {f: i for i, f in enumerate(factors)}
    forbidden_set, refused_set = _canon(forbidden, factors), _canon(refused, factors)
    banned = forbidden_set | refused_set
    rows = covering_array(factors, _avoiding(factors, banned))
    refusal_rows = []
    for a, va, b, vb in sorted(refused_set, key=lambda p: (order[p[0]], order[p[2]], factors[p[0]].index(p[1]),
                                                          factors[p[2]].index(p[3]))):
        row = _completable(factors, _avoiding(factors, banned - {(a, va, b, vb)}), {a: va, b: vb})
        if row is None:
            raise ValueError(f"refused pair {((a, va), (b, vb))}: no row holds it without a forbidden pair")
        refusal_rows.append((((a, va), (b, vb)), {n: row[n] for n in factors}))
    return rows, refusal_rows


def uncovered(rows: list, factors: dict, forbidden=(), refused=()) -> set:
    """Pairs neither forbidden nor refused that no row of ``rows`` holds."""
    banned = _canon(forbidden, factors) | _canon(refused, factors)
    held = set().union(*(row_pairs(r, factors) for r in rows)) if rows else set()
    return {p for p in all_pairs(factors) if p not in banned and p not in held}
