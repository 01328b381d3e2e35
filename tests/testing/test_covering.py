"""The pairwise covering-array generator of the configuration matrices (tests/support/covering.py): every allowed
pair covered, no row holding a forbidden or refused pair, one row per refused pair, deterministic, and small."""

from itertools import product

import pytest

from tests.support.covering import all_pairs, pairwise, row_pairs, uncovered

FACTORS = {"a": [0, 1, 2], "b": ["x", "y", "z"], "c": [False, True], "d": [False, True], "e": [1, 2, 4],
           "f": ["p", "q"], "g": [False, True]}
FORBIDDEN = [(("a", 2), ("c", True)), (("b", "z"), ("e", 4))]
REFUSED = [(("a", 1), ("f", "q")), (("e", 2), ("g", True))]


def _pairs(pairs):
    return {frozenset(p) for p in pairs}


@pytest.mark.parametrize("forbidden, refused", [((), ()), (FORBIDDEN, ()), (FORBIDDEN, REFUSED)])
def test_every_allowed_pair_covered_and_constraints_hold(forbidden, refused):
    rows, refusal_rows = pairwise(FACTORS, forbidden, refused)
    banned = _pairs(forbidden) | _pairs(refused)
    # independent check: each allowed pair, by brute force over the rows
    for a, va, b, vb in all_pairs(FACTORS):
        if frozenset(((a, va), (b, vb))) in banned:
            continue
        assert any(r[a] == va and r[b] == vb for r in rows), (a, va, b, vb)
    assert not uncovered(rows, FACTORS, forbidden, refused)
    for r in rows:
        assert set(r) == set(FACTORS) and all(r[f] in FACTORS[f] for f in FACTORS)
        assert not any(frozenset(((a, va), (b, vb))) in banned for a, va, b, vb in row_pairs(r, FACTORS)), r
    assert [p for p, _ in refusal_rows] == sorted(refused, key=lambda p: (list(FACTORS).index(p[0][0]), p))
    for pair, r in refusal_rows:
        held = {frozenset(((a, va), (b, vb))) for a, va, b, vb in row_pairs(r, FACTORS)}
        assert held & banned == {frozenset(pair)}, r
    # far fewer rows than the full product (3*3*2*2*3*2*2 = 432); at least the product of the two largest factors
    assert 9 <= len(rows) <= 15, len(rows)


def test_deterministic():
    assert pairwise(FACTORS, FORBIDDEN, REFUSED) == pairwise(FACTORS, FORBIDDEN, REFUSED)


def test_uncovered_checker():
    """The checker itself: the full product covers everything; dropping a row that alone holds a pair shows it."""
    full = [dict(zip(FACTORS, v)) for v in product(*FACTORS.values())]
    assert not uncovered(full, FACTORS)
    rows, _ = pairwise(FACTORS)
    missing = uncovered(rows[1:], FACTORS)
    assert missing and missing <= row_pairs(rows[0], FACTORS)


def test_unknown_levels_rejected():
    with pytest.raises(ValueError, match="constraint pair"):
        pairwise(FACTORS, forbidden=[(("a", 7), ("c", True))])
