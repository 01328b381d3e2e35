"""Benchmark: zorro's deduplicated forward vs the ordinary forward, measured against the FLOP-model ideal.

Run ``python -m zorro_verl.bench --quick`` (CPU, < 3 min; = ``--preset cpu-quick``), ``--preset gpu`` on a GPU,
``--ops`` for the op-level attention benchmark, ``--tree`` for prefix trees, ``--vlm`` for vision-language prompts and
``--megatron`` for megatron-core's ``GPTModel``, ``--memory`` for the bytes attention keeps for backward, ``--long`` for
an engine under sequence sharding (:mod:`.long_context`; the verl FSDP run in :mod:`.long_verl`).
One job per module: :mod:`.scenarios` (batch shapes),
:mod:`.presets` (settings and targets), :mod:`.models` (models from a config), :mod:`.flops` (the FLOP model of
docs/design/math.md), :mod:`.timing` (clock, memory, interleaved timer), :mod:`.runner` (model-level steps),
:mod:`.ops` (attention op per backend), :mod:`.tree` (prefix trees), :mod:`.vlm` (vision-language batches),
:mod:`.megatron` (megatron-core's ``GPTModel``; imports megatron-core only when its run starts),
:mod:`.memory` (attention's saved bytes per backend vs stock at one token budget),
:mod:`.report` (table, plot, targets), :mod:`.cli`.

Rows are dicts (times ms, memory MiB); imports transformers when a run starts (models are built from a config,
nothing is downloaded).
"""

from zorro_verl.bench.cli import main
from zorro_verl.bench.flops import flop_model
from zorro_verl.bench.ops import run_ops
from zorro_verl.bench.presets import PRESETS
from zorro_verl.bench.report import check_targets, format_table
from zorro_verl.bench.runner import run_bench
from zorro_verl.bench.scenarios import Scenario

__all__ = ["Scenario", "PRESETS", "flop_model", "run_bench", "run_ops", "format_table", "check_targets", "main"]
