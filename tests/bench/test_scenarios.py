"""Scenario parsing: the command-line form and its errors."""

import pytest

from zorro_verl.bench import Scenario
from zorro_verl.bench.scenarios import parse_scenario


def test_parse_scenario():
    assert parse_scenario("8,2,64,16") == Scenario("8x2x64x16", 8, 2, 64, 16, False)
    assert parse_scenario("8,2,64,16,ragged").ragged
    for bad in ("8,2,64", "8,9,64,16", "8,2,64,16,odd", "a,b,c,d"):
        with pytest.raises(ValueError, match="--scenario"):
            parse_scenario(bad)
