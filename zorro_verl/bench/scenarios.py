"""Benchmark scenarios: one micro-batch shape ``(B, G, P, R)`` and its command-line form ``"B,G,P,R[,ragged]"``.

A scenario's batch is :func:`zorro_verl.testing.create_dummy_batch` of those sizes: ``input_ids`` /
``attention_mask`` / ``position_ids`` ``[B, P+R] int64``, ``responses`` / ``response_mask`` ``[B, R] int64``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Scenario", "parse_scenario"]


@dataclass(frozen=True)
class Scenario:
    """One micro-batch shape: ``B`` rows, ``G`` unique prompts, prompt length ``P``, response length ``R``.

    ``ragged``: prompts of unequal valid length (left pad) and responses ending early (right pad), as
    :func:`zorro_verl.testing.create_dummy_batch` with ``add_padding=True`` makes them.
    """

    name: str
    B: int
    G: int
    P: int
    R: int
    ragged: bool = False

    @property
    def n(self) -> float:
        """Group size ``B / G``."""
        return self.B / self.G

    @property
    def ratio(self) -> float:
        """Prompt / response length ``P / R``."""
        return self.P / self.R


def parse_scenario(text: str) -> Scenario:
    """``"B,G,P,R"`` or ``"B,G,P,R,ragged"`` -> :class:`Scenario`."""
    parts = [p.strip() for p in text.split(",")]
    ragged = len(parts) == 5 and parts[4] == "ragged"
    if len(parts) not in (4, 5) or (len(parts) == 5 and not ragged) or not all(p.isdigit() for p in parts[:4]):
        raise ValueError(f"--scenario: expected 'B,G,P,R' or 'B,G,P,R,ragged' (ints), got {text!r}.")
    B, G, P, R = (int(p) for p in parts[:4])
    if not (1 <= G <= B and P >= 1 and R >= 1):
        raise ValueError(f"--scenario: expected 1 <= G <= B, P >= 1, R >= 1, got {text!r}.")
    return Scenario(f"{B}x{G}x{P}x{R}" + ("r" if ragged else ""), B, G, P, R, ragged)
