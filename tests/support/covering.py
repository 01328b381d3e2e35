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
"""

from __future__ import annotations

from itertools import combinations
from typing import Callable

__all__ = ["covering_array", "allowed_pairs", "uncovered_pairs"]

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
