"""Named benchmark presets: every setting of a run, and the targets its rows are judged against, spelled out.

A preset replaces what used to be chosen by detecting the device: ``cpu-quick`` (the CPU quick set, with its
targets), ``cpu-full`` (the quick set plus slower CPU scenarios, no targets) and ``gpu`` (bf16 Qwen3-0.6B shape on
CUDA). Command-line flags override single fields (:func:`zorro_verl.bench.cli.main`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from zorro_verl.bench.scenarios import Scenario

__all__ = ["Targets", "Preset", "PRESETS", "QUICK_SCENARIOS", "QUICK_PLAN_SCENARIO", "CPU_FULL_EXTRA",
           "GPU_SCENARIOS"]

#: The CPU quick set: the API example (8, 2, 4096, 512) scaled down 16x in length, group sizes 4 and 8,
#: P/R 4 and 8, a ragged case and no sharing at all (G = B).
QUICK_SCENARIOS = (
    Scenario("api/16", 8, 2, 256, 32),
    Scenario("n8", 8, 1, 256, 32),
    Scenario("pr4", 8, 2, 256, 64),
    Scenario("ragged", 8, 2, 256, 32, ragged=True),
    Scenario("noshare", 8, 8, 256, 32),
)
#: Plan-building check of the quick set: B = 512 rows in G = 64 groups (short rows: the harshest ratio).
QUICK_PLAN_SCENARIO = Scenario("plan512", 512, 64, 8, 2)
#: What ``cpu-full`` adds to the quick set: n = 2, P/R = 16 and the API example at full length (slow).
CPU_FULL_EXTRA = (Scenario("n2", 8, 4, 256, 32), Scenario("pr16", 8, 2, 512, 32), Scenario("api", 8, 2, 4096, 512))
#: Scenarios of the GPU run (bf16, Qwen3-0.6B shape).
GPU_SCENARIOS = (
    Scenario("api", 8, 2, 4096, 512),
    Scenario("n16", 16, 1, 8192, 1024),
)


@dataclass(frozen=True)
class Targets:
    """Pass/fail thresholds on ``fwd_bwd`` rows against the ``a2a`` baseline (judged on the paired estimates, see
    :func:`zorro_verl.bench.report.check_targets`). ``None`` switches a check off.

    * ``efficiency``: ``efficiency_paired >= efficiency`` on rows with ``P/R >= efficiency_min_pr`` and
      ``n >= efficiency_min_n`` and some sharing (``G < B``); with ``efficiency_shapes`` only on those
      ``(B, G, P, R)``.
    * ``noshare_time``: zorro / baseline time ``<= noshare_time`` where nothing is shared (``G == B``).
    * ``plan_fraction``: plan building ``<= plan_fraction`` of a zorro ``fwd_bwd`` step (the plan-check row).
    """

    efficiency: Optional[float] = None
    efficiency_min_pr: float = 4.0
    efficiency_min_n: float = 4.0
    efficiency_shapes: Optional[tuple[tuple[int, int, int, int], ...]] = None
    noshare_time: Optional[float] = None
    plan_fraction: Optional[float] = None


@dataclass(frozen=True)
class Preset:
    """Every setting of a benchmark run.

    ``dtype``: a ``torch`` dtype name (``float32``, ``bfloat16``, ...); ``model``: a key of
    :data:`zorro_verl.bench.models.MODEL_SHAPES` / ``HYBRID_SHAPES``; ``clock``: ``cpu`` (process CPU time) or
    ``wall``; ``threads``: torch intra-op threads on CPU; ``backends``: zorro backends of the model-level bench
    (``None``: every backend available on the device); ``plan_scenario``: the plan-building check (``None``: off);
    ``targets``: the thresholds its rows are judged against on ``device`` (``None``: no checks); ``lora_rank``: 0
    (full fine-tuning) or the rank of a LoRA adapter on every linear layer but the head (LoRA training).
    """

    name: str
    device: str
    dtype: str
    model: str
    scenarios: tuple[Scenario, ...]
    clock: str
    threads: int
    grad_ckpt: bool
    backends: Optional[tuple[str, ...]] = None
    plan_scenario: Optional[Scenario] = None
    targets: Optional[Targets] = None
    lora_rank: int = 0


#: The CPU targets: the deduplicated step reaches >= 85% of the FLOP model's ideal where the prompt dominates
#: (P/R >= 4, n >= 4), costs <= 5% extra where nothing is shared, and its plan is <= 2% of a step.
CPU_TARGETS = Targets(efficiency=0.85, efficiency_min_pr=4.0, efficiency_min_n=4.0, noshare_time=1.05,
                      plan_fraction=0.02)

PRESETS = {
    # sdpa only: the reference backend whose figures docs/BENCHMARKS.md quotes (the other CPU backends are the
    # explicit-math and row-layout variants of the same computation; pass --backends to time them too).
    "cpu-quick": Preset("cpu-quick", device="cpu", dtype="float32", model="quick", scenarios=QUICK_SCENARIOS,
                        clock="cpu", threads=1, grad_ckpt=False, backends=("sdpa",),
                        plan_scenario=QUICK_PLAN_SCENARIO, targets=CPU_TARGETS),
    "cpu-full": Preset("cpu-full", device="cpu", dtype="float32", model="quick",
                       scenarios=QUICK_SCENARIOS + CPU_FULL_EXTRA, clock="cpu", threads=1, grad_ckpt=False,
                       backends=("sdpa",)),
    # Gradient checkpointing on as verl runs it; wall clock with CUDA syncs; every available backend.
    "gpu": Preset("gpu", device="cuda", dtype="bfloat16", model="qwen3-0.6b", scenarios=GPU_SCENARIOS,
                  clock="wall", threads=1, grad_ckpt=True,
                  targets=Targets(efficiency=0.85, efficiency_shapes=((8, 2, 4096, 512),))),
}
