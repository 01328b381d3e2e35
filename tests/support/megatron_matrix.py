"""The pairwise configuration matrix of verl 0.9's Megatron engine (tests/integrations/megatron/test_matrix.py;
never shipped): its factors, constraints, cases and each case's process layout. Imports nothing heavy (the cases are
computed in the test process and in every rank process alike).

Factors (the engine's options):

* ``builder``: verl's Megatron-Bridge (its default, ``vanilla_mbridge=False``) or the legacy vanilla mbridge;
* ``tp`` (1, 2), ``sp`` (sequence parallelism; on needs TP = 2), ``pp`` (1, 2), ``vpp`` (2 virtual stages per
  pipeline stage on a 4-layer checkpoint; on needs PP = 2);
* ``dynamic``: ``use_dynamic_bsz`` (a token budget) or fixed micro-batch sizes;
* ``sharing``: zorro's ``prompt`` dedup or the ``prefix`` tree (on prompts with a common start);
* ``model``: a dense Qwen3-like checkpoint, Qwen3-MoE (4 experts, top-2) with EP = 1, or with EP = 2 (expert tensor
  parallelism 1: the expert-parallel group is the TP group when TP = 2, else the DP group);
* ``lora``: verl's Megatron LoRA (Megatron-Bridge PEFT; verl asserts "LoRA/PEFT only supported via Megatron-Bridge",
  so LoRA with vanilla mbridge is excluded: a constraint, not a zorro refusal);
* ``fused``: ``use_fused_kernels`` on the zorro engine (verl's fused head is a CUDA Triton kernel: the stock reference
  runs the non-fused head, as tests/integrations/megatron/test_engine_vpp.py).

The world of a case is TP x PP x DP: DP = 2 where EP = 2 needs a second rank beside TP = 1, and where TP = PP = 1
(the cases then share the 2-process group: one process group per world size, 2 and 4).
"""

from __future__ import annotations

from tests.support.covering import covering_array

__all__ = ["FACTORS", "allowed", "CASES", "world_of", "dp_of", "case_name", "cases_of_world", "WORLDS"]

FACTORS: dict[str, list] = {
    "builder": ["megatron-bridge", "mbridge"],
    "tp": [1, 2],
    "sp": [False, True],
    "pp": [1, 2],
    "vpp": [False, True],
    "dynamic": [False, True],
    "sharing": ["prompt", "prefix"],
    "model": ["dense", "moe_ep1", "moe_ep2"],
    "lora": [False, True],
    "fused": [False, True],
}


def allowed(a: dict) -> bool:
    """The constraints, on a partial assignment ``a`` (False only when the values given already break one)."""
    if a.get("sp") is True and a.get("tp", 2) != 2:  # megatron: no sequence parallelism without TP
        return False
    if a.get("vpp") is True and a.get("pp", 2) != 2:  # virtual stages need a pipeline
        return False
    # verl's Megatron LoRA is Megatron-Bridge's PEFT (verl asserts the bridge)
    return not (a.get("lora") is True and a.get("builder", "megatron-bridge") != "megatron-bridge")


#: the cases, in the generator's order
CASES: list[dict] = covering_array(FACTORS, allowed)


def dp_of(case: dict) -> int:
    """Data-parallel size: 2 where TP = PP = 1 (so every case has a second rank) or where EP = 2 needs one beside
    TP = 1 (the experts are split over the DP group)."""
    if case["tp"] * case["pp"] == 1:
        return 2
    return 2 if case["model"] == "moe_ep2" and case["tp"] == 1 else 1


def world_of(case: dict) -> int:
    return case["tp"] * case["pp"] * dp_of(case)


def case_name(case: dict) -> str:
    """A short id: ``mb-tp2sp-pp2vpp-dyn-prefix-moe_ep2-lora-fused`` (options off are left out)."""
    parts = ["mb" if case["builder"] == "megatron-bridge" else "mbridge",
             f"tp{case['tp']}" + ("sp" if case["sp"] else ""), f"pp{case['pp']}" + ("vpp" if case["vpp"] else ""),
             "dyn" if case["dynamic"] else "fixed", case["sharing"], case["model"]]
    return "-".join(parts + [k for k in ("lora", "fused") if case[k]])


#: the world sizes of the cases (one process group each)
WORLDS = sorted({world_of(c) for c in CASES})


def cases_of_world(world: int) -> list[dict]:
    return [c for c in CASES if world_of(c) == world]
