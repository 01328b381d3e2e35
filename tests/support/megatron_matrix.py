"""The pairwise configuration matrix of verl 0.9's Megatron engine (tests/integrations/megatron/test_matrix.py;
never shipped): its factors, constraints, cases and each case's process layout. Imports nothing heavy (the cases are
computed in the test process and in every rank process alike).

Factors (the engine's options):

* ``builder``: verl's Megatron-Bridge (its default, ``vanilla_mbridge=False``) or the legacy vanilla mbridge;
* ``tp`` (1, 2), ``sp`` (sequence parallelism; on needs TP = 2, and MoE with TP = 2 needs it: megatron's MoE layer
  raises in training without), ``pp`` (1, 2), ``vpp`` (2 virtual stages per pipeline stage on a 4-layer checkpoint;
  on needs PP = 2);
* ``dynamic``: ``use_dynamic_bsz`` (a token budget) or fixed micro-batch sizes;
* ``sharing``: zorro's ``prompt`` dedup or the ``prefix`` tree (on prompts with a common start);
* ``model``: a dense Qwen3-like checkpoint, Qwen3-MoE (4 experts, top-2) with EP = 1, or with EP = 2 (verl's default
  expert tensor parallelism, = TP: the experts are split over DP = 2; with TP = PP = 2 that needs 8 ranks, excluded);
* ``lora``: verl's Megatron LoRA (Megatron-Bridge PEFT; verl asserts "LoRA/PEFT only supported via Megatron-Bridge",
  so LoRA with vanilla mbridge is excluded: a constraint, not a zorro refusal);
* ``fused``: ``use_fused_kernels`` on the zorro engine (verl's fused head is a CUDA Triton kernel: the stock reference
  runs the non-fused head, as tests/integrations/megatron/test_engine_vpp.py).

The world of a case is TP x PP x DP: DP = 2 where EP = 2 needs it, and where TP = PP = 1 (those cases then share the
2-process group: one process group per world size, 2 and 4).
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
    # megatron's MoE layer raises in training with TP > 1 and no sequence parallelism ("During training, performance
    # may degrade if MoE and tensor parallelism are enabled without also enabling sequence parallelism")
    if a.get("model", "dense") != "dense" and a.get("tp") == 2 and a.get("sp") is False:
        return False
    # EP = 2 beside TP = 2 x PP = 2 needs 8 ranks (verl's default expert TP = TP: the expert grid is TP x EP x PP)
    if a.get("model") == "moe_ep2" and a.get("tp") == 2 and a.get("pp") == 2:
        return False
    # verl's Megatron LoRA is Megatron-Bridge's PEFT (verl asserts the bridge)
    return not (a.get("lora") is True and a.get("builder", "megatron-bridge") != "megatron-bridge")


#: the cases, in the generator's order
CASES: list[dict] = covering_array(FACTORS, allowed)


def dp_of(case: dict) -> int:
    """Data-parallel size: 2 where TP = PP = 1 (so every case has a second rank) or where EP = 2 needs it (verl's
    default expert TP = TP: the experts of a TP x PP grid are split over DP = 2)."""
    return 2 if case["tp"] * case["pp"] == 1 or case["model"] == "moe_ep2" else 1


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
