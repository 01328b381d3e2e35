"""The pairwise covering-array generator of the configuration-matrix tests (tests/support/covering.py): every allowed
pair covered, every case within the constraints, pairs excluded through a chain of constraints recognised, the
result deterministic. Against a brute-force oracle: the allowed pairs are the pairs of the full assignments that
satisfy the constraints (all of them enumerated)."""

from __future__ import annotations

from itertools import combinations, product

import pytest

from tests.support.covering import allowed_pairs, covering_array, uncovered_pairs


def brute_allowed_pairs(factors, allowed):
    names = list(factors)
    out = set()
    for values in product(*factors.values()):
        case = dict(zip(names, values))
        if allowed(case):
            out |= {(a, factors[a].index(case[a]), b, factors[b].index(case[b])) for a, b in combinations(names, 2)}
    return out


def chain(a: dict) -> bool:
    """x = 1 needs y = 1, y = 1 needs z = 2: (x = 1, z = 0) is excluded only through y."""
    if a.get("x") == 1 and a.get("y", 1) != 1:
        return False
    return not (a.get("y") == 1 and a.get("z", 2) != 2)


CASES = {
    "unconstrained 2^5": ({f"f{i}": [0, 1] for i in range(5)}, lambda a: True),
    "mixed 3x2x4x2": ({"a": [0, 1, 2], "b": ["p", "q"], "c": [0, 1, 2, 3], "d": [False, True]}, lambda a: True),
    "chained": ({"x": [0, 1], "y": [0, 1], "z": [0, 1, 2], "w": [0, 1]}, chain),
    "megatron matrix": (None, None),
}


@pytest.mark.parametrize("name", list(CASES))
def test_covers_every_allowed_pair_within_constraints(name):
    factors, allowed = CASES[name]
    if factors is None:
        from tests.support.megatron_matrix import FACTORS
        from tests.support.megatron_matrix import allowed as allowed_m

        factors, allowed = FACTORS, allowed_m
    cases = covering_array(factors, allowed)
    assert allowed_pairs(factors, allowed) == brute_allowed_pairs(factors, allowed)
    assert not uncovered_pairs(factors, allowed, cases)
    for case in cases:
        assert set(case) == set(factors) and all(case[k] in factors[k] for k in factors)
        assert allowed(case), case
    assert covering_array(factors, allowed) == cases  # deterministic
    # a lower bound: the two largest factors' value pairs each need a case
    sizes = sorted(len(v) for v in factors.values())
    assert len(cases) >= sizes[-1] * sizes[-2] or name == "chained"
    print(f"{name}: {len(cases)} cases, {len(brute_allowed_pairs(factors, allowed))} allowed pairs")


def test_chain_excluded_pair_is_not_required():
    factors, allowed = CASES["chained"]
    pairs = allowed_pairs(factors, allowed)
    assert ("x", 1, "z", 0) not in pairs and ("x", 1, "z", 2) in pairs
    assert allowed({"x": 1, "z": 0})  # the predicate alone does not see it


def test_refuses_duplicate_values():
    with pytest.raises(ValueError, match="distinct values"):
        covering_array({"a": [1, 1]})
