"""``python -m zorro_verl.bench`` / ``zorro-verl bench``: the argument parser and ``main``.

Settings come from a preset (:data:`zorro_verl.bench.presets.PRESETS`; ``--quick`` = ``--preset cpu-quick``;
neither: ``cpu-quick``'s settings, whatever the device) and single flags override its fields. ``--ops`` runs the
op-level attention benchmark instead of the model-level one, ``--tree`` the prefix-tree benchmark and ``--vlm`` the
vision-language one (its own settings: :data:`zorro_verl.bench.vlm.VLM_PRESETS`, ``--preset gpu`` picks the GPU
ones). ``--megatron`` runs zorro on megatron-core's ``GPTModel`` (:mod:`zorro_verl.bench.megatron`; megatron-core
installed, and on the CPU a repository checkout on ``PYTHONPATH`` for its CPU shims). ``--memory`` counts the bytes
one layer's attention keeps for backward per backend vs stock at one token budget, bf16 (:mod:`zorro_verl.bench.memory`;
on CUDA also speed and peak memory). Exit code 1 if a target check fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Optional

import torch

from zorro_verl.bench.presets import PRESETS, QUICK_PLAN_SCENARIO, Preset
from zorro_verl.bench.report import check_targets, format_table, plot
from zorro_verl.bench.scenarios import parse_scenario

__all__ = ["main", "resolve", "resolve_vlm", "settings", "DTYPES"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64, "float16": torch.float16}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m zorro_verl.bench",
                                description="Benchmark: zorro's deduplicated forward vs the ordinary forward, "
                                            "measured against the FLOP-model ideal.")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="every setting at once (default: cpu-quick's settings, on any device); flags below "
                        "override single fields")
    p.add_argument("--quick", action="store_true", help="alias of --preset cpu-quick (< 3 min on a 2-core host, "
                                                        "with target checks)")
    p.add_argument("--tree", action="store_true",
                   help="run the prefix-tree benchmark (agentic batches: ordinary vs prompt sharing vs "
                        "sharing=prefix, CPU quick set with its targets) instead of the model-level one")
    p.add_argument("--vlm", action="store_true",
                   help="run the vision-language benchmark (a Qwen2.5-VL-shaped model, prompts with images: "
                        "ordinary forward vs zorro, ideal with the vision tower; CPU set with its targets, "
                        "--preset gpu: the GPU scenario) instead of the model-level one")
    p.add_argument("--vlm-scenario", action="append", default=None, metavar="NAME|B,G,I,T,R[,K]",
                   help="with --vlm: a named scenario (img256, 2img64, noshare, img1024) or B rows, G prompts, I image "
                        "tokens per image (a square), T text tokens, R response tokens, K images per prompt; "
                        "repeatable, replaces the preset's")
    p.add_argument("--megatron", action="store_true",
                   help="run the Megatron benchmark (megatron-core's GPTModel, local spec: megatron's ordinary forward "
                        "vs zorro, fp32 and bf16, with its targets) instead of the model-level one; needs "
                        "megatron-core, and on the CPU the repository checkout on PYTHONPATH (its CPU shims): "
                        "PYTHONPATH=<repo> .venv-megatron/bin/python -m zorro_verl.bench --megatron")
    p.add_argument("--megatron-scenario", action="append", default=None, metavar="NAME|B,G,P,R_MIN,R_MAX",
                   help="with --megatron: a named scenario (grpo, noshare) or B rows, G prompts of 7P/8..P tokens, "
                        "responses of R_MIN..R_MAX tokens; repeatable, replaces the default pair")
    p.add_argument("--memory", action="store_true",
                   help="run the attention-memory benchmark (bytes one layer's attention keeps for backward, every "
                        "backend vs the stock flash path at the same token budget, bf16; CPU: the GPU index logic "
                        "over stand-in kernels; CUDA: real kernels, also ms and peak memory) instead of the "
                        "model-level one; checks that flash_copyfree keeps at most stock's bytes")
    p.add_argument("--memory-scenario", action="append", default=None, metavar="NAME|G,n,P,R,Hq,Hkv,D",
                   help="with --memory: a named scenario (gqa, gqa-longresp, mha) or G prompts, n responses each, "
                        "prompt / response lengths, query / kv heads, head dim; repeatable, replaces the default "
                        "three")
    p.add_argument("--long", action="store_true",
                   help="run the long-context benchmark (an engine at sequence sharding degree 2, zorro vs stock at "
                        "the same sharding: times, ideal, efficiency, tokens and collective bytes per rank counted "
                        "and checked against the cost model) instead of the model-level one; CPU: the repository "
                        "checkout on PYTHONPATH (its CPU shims); --preset gpu: the 16K / 32K scenarios on "
                        "qwen3-0.6b, bf16, one rank per GPU")
    p.add_argument("--long-scenario", action="append", default=None, metavar="NAME|G,n,P,R_MIN,R_MAX,BUDGET",
                   help="with --long: a named scenario (2k-n8, 16k-n16, 32k-n8) or G prompts of P tokens x n "
                        "rollouts of R_MIN..R_MAX tokens, BUDGET tokens per rank and micro-batch; repeatable")
    p.add_argument("--long-engine", default="verl-fsdp",
                   help="with --long: the engine whose row runs (verl-fsdp: verl's FSDP engine under Ulysses SP; "
                        "verl-megatron: its Megatron engine under context parallelism)")
    p.add_argument("--long-degree", type=int, default=2, help="with --long: the sharding degree (ranks)")
    p.add_argument("--ops", action="store_true",
                   help="run the op-level attention benchmark (each backend's attend vs the ordinary per-row SDPA) "
                        "instead of the model-level one; backends: --backends or every available one")
    p.add_argument("--device", default=None, help="cpu or cuda (preset: cpu-quick/cpu-full cpu, gpu cuda)")
    p.add_argument("--scenario", action="append", default=None, metavar="B,G,P,R[,ragged]",
                   help="a scenario (repeatable), replaces the preset's; without --preset also drops the plan "
                        "check and the targets")
    p.add_argument("--modes", default="fwd,fwd_bwd", help="comma list of fwd, fwd_bwd")
    p.add_argument("--backends", default=None,
                   help="comma list of zorro backends (preset: sdpa on the CPU presets, every available on gpu)")
    p.add_argument("--model", default=None, help="model shape, e.g. quick, qwen3-0.6b, hybrid-quick")
    p.add_argument("--dtype", default=None, help=f"one of {sorted(DTYPES)} (preset: float32 CPU, bfloat16 gpu)")
    p.add_argument("--reps", type=int, default=5, help="timed runs per figure (>= 5); the median is reported")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs first")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads on CPU (presets: 1)")
    p.add_argument("--clock", default=None, help="wall or cpu (preset: cpu time on CPU, wall on gpu)")
    p.add_argument("--grad-ckpt", action=argparse.BooleanOptionalAction, default=None,
                   help="gradient checkpointing (preset: off on CPU, on for gpu)")
    p.add_argument("--baseline-rows", type=int, default=None,
                   help="run the full-logits baseline in chunks of this many rows (memory); default: all rows "
                        "on CPU, what fits ~24 GiB on CUDA")
    p.add_argument("--no-full", action="store_true", help="skip the full-logits baseline")
    p.add_argument("--lora", type=int, default=None, metavar="RANK",
                   help="LoRA training: a PEFT adapter of this rank on every linear layer but the head, base "
                        "weights frozen (both sides); 0: full fine-tuning (preset: 0)")
    p.add_argument("--plan-check", action="store_true",
                   help=f"also measure plan building (preset's, else B={QUICK_PLAN_SCENARIO.B}, "
                        f"G={QUICK_PLAN_SCENARIO.G})")
    p.add_argument("--json", default=None, metavar="PATH", help="write the rows as a JSON list")
    p.add_argument("--plot", default=None, metavar="PATH", help="write a PNG of speedup and ideal")
    return p


def resolve(args: argparse.Namespace) -> Preset:
    """The run's settings: the preset named (``--quick`` = ``cpu-quick``; none: ``cpu-quick``'s) with every flag
    given overriding its field. Targets belong to the preset's device: a run moved to another device type drops
    them. Without a preset, ``--scenario`` makes an ad-hoc grid with no plan check and no targets unless
    ``--plan-check`` asks for both."""
    name = args.preset
    if args.quick:
        if name not in (None, "cpu-quick"):
            raise ValueError(f"--quick: an alias of --preset cpu-quick, but --preset {name} was given too.")
        name = "cpu-quick"
    base = PRESETS[name or "cpu-quick"]
    s = base
    if name is None and args.scenario:
        s = dataclasses.replace(s, plan_scenario=None, targets=None)
    over = {}
    if args.device is not None:
        over["device"] = args.device
    if args.dtype is not None:
        if args.dtype not in DTYPES:
            raise ValueError(f"--dtype: expected one of {sorted(DTYPES)}, got {args.dtype!r}.")
        over["dtype"] = args.dtype
    if args.model is not None:
        over["model"] = args.model
    if args.scenario:
        over["scenarios"] = tuple(parse_scenario(t) for t in args.scenario)
    if args.clock is not None:
        over["clock"] = args.clock
    if args.threads is not None:
        over["threads"] = args.threads
    if args.grad_ckpt is not None:
        over["grad_ckpt"] = args.grad_ckpt
    if args.lora is not None:
        if args.lora < 0:
            raise ValueError(f"--lora: expected a LoRA rank >= 1, or 0 for full fine-tuning, got {args.lora}.")
        over["lora_rank"] = args.lora
    if args.backends:
        over["backends"] = tuple(b.strip() for b in args.backends.split(","))
    if args.plan_check:
        over["plan_scenario"] = s.plan_scenario or QUICK_PLAN_SCENARIO
        if s.targets is None and name is None:  # as --quick's checks, on the rows of the grid given
            over["targets"] = base.targets
    s = dataclasses.replace(s, **over)
    if torch.device(s.device).type != torch.device(base.device).type:
        s = dataclasses.replace(s, targets=None)
    return s


def resolve_vlm(args: argparse.Namespace):
    """The ``--vlm`` run's settings: :data:`~zorro_verl.bench.vlm.VLM_PRESETS` ``gpu`` with ``--preset gpu``, else
    ``cpu``; ``--device``, ``--dtype``, ``--model`` (a VLM shape), ``--clock``, ``--threads``, ``--grad-ckpt`` and
    ``--vlm-scenario`` override single fields. Targets apply on the preset's device type only."""
    from zorro_verl.bench.models import VLM_SHAPES
    from zorro_verl.bench.vlm import VLM_PRESETS, parse_vlm_scenario

    bad = [flag for flag, on in (("--tree", args.tree), ("--ops", args.ops), ("--scenario", args.scenario),
                                 ("--lora", args.lora), ("--plot", args.plot), ("--plan-check", args.plan_check))
           if on]
    if bad:
        raise ValueError(f"--vlm: {bad} belong to the other benchmarks (scenarios of a --vlm run: --vlm-scenario).")
    base = VLM_PRESETS["gpu" if args.preset == "gpu" else "cpu"]
    over = {}
    for field, val in (("device", args.device), ("dtype", args.dtype), ("model", args.model), ("clock", args.clock),
                       ("threads", args.threads), ("grad_ckpt", args.grad_ckpt)):
        if val is not None:
            over[field] = val
    if args.dtype is not None and args.dtype not in DTYPES:
        raise ValueError(f"--dtype: expected one of {sorted(DTYPES)}, got {args.dtype!r}.")
    if args.model is not None and args.model not in VLM_SHAPES:
        raise ValueError(f"--model: a --vlm run expects one of {sorted(VLM_SHAPES)}, got {args.model!r}.")
    if args.vlm_scenario:
        over["scenarios"] = tuple(parse_vlm_scenario(t) for t in args.vlm_scenario)
    s = dataclasses.replace(base, **over)
    if torch.device(s.device).type != torch.device(base.device).type:
        s = dataclasses.replace(s, targets=False)
    return s


def _finish(rows: list[dict], json_path, table: str, checks: list[str], what: str, device, t0: float) -> int:
    """Write the rows (``--json``), print the table, the target lines and the total; exit code 1 on a ``FAIL``."""
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)
    print()
    print(table)
    for line in checks:
        print(line)
    print(f"total {time.perf_counter() - t0:.0f} s; {what}; device: {rows[0]['device'] if rows else device}")
    return 1 if any(c.startswith("FAIL") for c in checks) else 0


def _main_vlm(args: argparse.Namespace, modes: tuple, t0: float) -> int:
    from zorro_verl.bench.vlm import check_vlm_targets, format_vlm_table, run_vlm_bench

    s = resolve_vlm(args)
    cuda = torch.device(s.device).type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise ValueError("--device: cuda requested but torch.cuda.is_available() is False; use --device cpu.")
    if not cuda:
        torch.set_num_threads(s.threads)
    rows = run_vlm_bench(s.scenarios, modes=modes, model_shape=s.model, dtype=DTYPES[s.dtype], device=s.device,
                         warmup=args.warmup, reps=args.reps, clock=s.clock, grad_ckpt=s.grad_ckpt,
                         backend=args.backends.split(",")[0].strip() if args.backends else "sdpa")
    return _finish(rows, args.json, format_vlm_table(rows), check_vlm_targets(rows) if s.targets else [],
                   f"vision-language benchmark ({s.name}, model {s.model})", s.device, t0)


def _main_megatron(args: argparse.Namespace, modes: tuple, t0: float) -> int:
    """``--megatron``: its own settings (shape ``quick``, fp32 + bf16, CPU, 1 thread, CPU clock); ``--device``,
    ``--dtype`` (one dtype instead of both), ``--model``, ``--clock``, ``--threads``, ``--backends`` (the first) and
    ``--megatron-scenario`` override them. Targets apply to the fp32 rows on the CPU."""
    from zorro_verl.bench.megatron import (
        MEGATRON_DTYPES,
        MEGATRON_SCENARIOS,
        MEGATRON_SHAPES,
        check_megatron_targets,
        format_megatron_table,
        megatron_setup,
        parse_megatron_scenario,
        run_megatron_bench,
    )

    bad = [flag for flag, on in (("--tree", args.tree), ("--ops", args.ops), ("--vlm", args.vlm),
                                 ("--scenario", args.scenario), ("--lora", args.lora), ("--plot", args.plot),
                                 ("--plan-check", args.plan_check), ("--preset", args.preset), ("--quick", args.quick),
                                 ("--grad-ckpt", args.grad_ckpt)) if on]
    if bad:
        raise ValueError(f"--megatron: {bad} belong to the other benchmarks (scenarios of a --megatron run: "
                         "--megatron-scenario).")
    if args.dtype is not None and args.dtype not in DTYPES:
        raise ValueError(f"--dtype: expected one of {sorted(DTYPES)}, got {args.dtype!r}.")
    model = args.model or "quick"
    if model not in MEGATRON_SHAPES:
        raise ValueError(f"--model: a --megatron run expects one of {sorted(MEGATRON_SHAPES)}, got {model!r}.")
    device = args.device or "cpu"
    cuda = torch.device(device).type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise ValueError("--device: cuda requested but torch.cuda.is_available() is False; use --device cpu.")
    if not cuda:
        torch.set_num_threads(args.threads or 1)
    scenarios = tuple(parse_megatron_scenario(t) for t in args.megatron_scenario) if args.megatron_scenario \
        else MEGATRON_SCENARIOS
    try:
        import megatron.core  # noqa: F401
    except ImportError as e:
        raise RuntimeError(f"--megatron: megatron-core is not installed in this environment ({e}); "
                           "scripts/setup_megatron_env.sh builds .venv-megatron.") from None
    rows = run_megatron_bench(scenarios, setup=megatron_setup(device), modes=modes,
                              dtypes=(DTYPES[args.dtype],) if args.dtype else MEGATRON_DTYPES, model_shape=model,
                              device=device, warmup=args.warmup, reps=args.reps,
                              clock=args.clock or ("wall" if cuda else "cpu"),
                              backend=args.backends.split(",")[0].strip() if args.backends else "sdpa")
    return _finish(rows, args.json, format_megatron_table(rows), check_megatron_targets(rows) if not cuda else [],
                   f"Megatron GPTModel benchmark (model {model})", device, t0)


def _main_memory(args: argparse.Namespace, t0: float) -> int:
    """``--memory``: its own settings (the three scenarios of :data:`~zorro_verl.bench.memory.MEMORY_SCENARIOS`, every
    registered backend, bf16, CPU); ``--device``, ``--dtype``, ``--backends``, ``--threads``, ``--reps`` / ``--warmup``
    (CUDA timing) and ``--memory-scenario`` override them."""
    from zorro_verl.bench.memory import (
        MEMORY_SCENARIOS,
        check_memory_rule,
        format_memory_table,
        parse_memory_scenario,
        run_memory,
    )

    bad = [flag for flag, on in (("--tree", args.tree), ("--ops", args.ops), ("--vlm", args.vlm),
                                 ("--megatron", args.megatron), ("--scenario", args.scenario), ("--lora", args.lora),
                                 ("--plot", args.plot), ("--plan-check", args.plan_check), ("--preset", args.preset),
                                 ("--quick", args.quick), ("--model", args.model)) if on]
    if bad:
        raise ValueError(f"--memory: {bad} belong to the other benchmarks (scenarios of a --memory run: "
                         "--memory-scenario).")
    if args.dtype is not None and args.dtype not in DTYPES:
        raise ValueError(f"--dtype: expected one of {sorted(DTYPES)}, got {args.dtype!r}.")
    device = args.device or "cpu"
    cuda = torch.device(device).type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise ValueError("--device: cuda requested but torch.cuda.is_available() is False; use --device cpu.")
    if not cuda:
        torch.set_num_threads(args.threads or 1)
    scenarios = tuple(parse_memory_scenario(t) for t in args.memory_scenario) if args.memory_scenario \
        else MEMORY_SCENARIOS
    rows = run_memory(scenarios, backends=[b.strip() for b in args.backends.split(",")] if args.backends else None,
                      device=device, dtype=DTYPES[args.dtype or "bfloat16"], warmup=args.warmup, reps=args.reps)
    return _finish(rows, args.json, format_memory_table(rows), check_memory_rule(rows),
                   "attention-memory benchmark (saved bytes for backward vs stock at the same token budget)", device,
                   t0)


def _main_long(args: argparse.Namespace, t0: float) -> int:
    """``--long``: CPU default (scenario ``2k-n8``, shape ``long-tiny``, fp32); ``--preset gpu``: the
    GPU scenarios on ``qwen3-0.6b``, bf16, CUDA; ``--long-scenario``, ``--model``, ``--dtype``, ``--device``,
    ``--clock``, ``--backends`` (the first), ``--grad-ckpt`` (default: on CUDA only), ``--reps`` and ``--warmup``
    override them."""
    from zorro_verl.bench.long_context import (
        LONG_CPU_SCENARIOS,
        LONG_GPU_SCENARIOS,
        check_long_rows,
        format_long_table,
        parse_long_scenario,
        run_long_bench,
    )

    bad = [flag for flag, on in (("--tree", args.tree), ("--ops", args.ops), ("--vlm", args.vlm),
                                 ("--megatron", args.megatron), ("--memory", args.memory),
                                 ("--scenario", args.scenario), ("--lora", args.lora), ("--plot", args.plot),
                                 ("--plan-check", args.plan_check), ("--quick", args.quick)) if on]
    if bad:
        raise ValueError(f"--long: {bad} belong to the other benchmarks (scenarios of a --long run: --long-scenario).")
    if args.preset not in (None, "gpu"):
        raise ValueError(f"--long: --preset gpu (or none) expected, got --preset {args.preset}.")
    gpu = args.preset == "gpu"
    dtype = args.dtype or ("bfloat16" if gpu else "float32")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype: expected one of {sorted(DTYPES)}, got {dtype!r}.")
    device = args.device or ("cuda" if gpu else "cpu")
    if torch.device(device).type == "cuda" and torch.cuda.device_count() < args.long_degree:
        raise ValueError(f"--long-degree {args.long_degree} on CUDA: one rank per GPU, but "
                         f"{torch.cuda.device_count()} GPU(s) are visible.")
    scenarios = tuple(parse_long_scenario(t) for t in args.long_scenario) if args.long_scenario \
        else (LONG_GPU_SCENARIOS if gpu else LONG_CPU_SCENARIOS)
    rows = run_long_bench(scenarios, engine=args.long_engine, degree=args.long_degree,
                          model=args.model or ("qwen3-0.6b" if gpu else "long-tiny"), dtype=dtype, device=device,
                          reps=args.reps, warmup=args.warmup, clock=args.clock,
                          backend=args.backends.split(",")[0].strip() if args.backends else None,
                          grad_ckpt=args.grad_ckpt)
    return _finish(rows, args.json, format_long_table(rows), check_long_rows(rows, dtype),
                   f"long-context benchmark ({args.long_engine})", device, t0)


def settings(argv: list[str]) -> Preset:
    """The settings a command line resolves to (:func:`resolve` of its parsed arguments)."""
    return resolve(_parser().parse_args(argv))


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.vlm_scenario and not args.vlm:
        raise ValueError("--vlm-scenario: a scenario of the vision-language benchmark; add --vlm.")
    if args.megatron_scenario and not args.megatron:
        raise ValueError("--megatron-scenario: a scenario of the Megatron benchmark; add --megatron.")
    if (args.long_scenario or args.long_engine != "verl-fsdp" or args.long_degree != 2) and not args.long:
        raise ValueError("--long-scenario / --long-engine / --long-degree: settings of the long-context benchmark; "
                         "add --long.")
    if args.long:
        return _main_long(args, time.perf_counter())
    if args.memory_scenario and not args.memory:
        raise ValueError("--memory-scenario: a scenario of the attention-memory benchmark; add --memory.")
    if args.memory:
        return _main_memory(args, time.perf_counter())
    if args.vlm or args.megatron:
        modes = tuple(m.strip() for m in args.modes.split(","))
        if not set(modes) <= {"fwd", "fwd_bwd"}:
            raise ValueError(f"--modes: expected a comma list of fwd, fwd_bwd, got {args.modes!r}.")
        if args.megatron:
            return _main_megatron(args, modes, time.perf_counter())
        return _main_vlm(args, modes, time.perf_counter())
    s = resolve(args)
    cuda = torch.device(s.device).type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise ValueError("--device: cuda requested but torch.cuda.is_available() is False; use --device cpu.")
    if cuda and s.clock == "cpu":
        print("note: --clock cpu on CUDA counts host CPU time only; --preset gpu or --clock wall times the device.",
              file=sys.stderr)
    if not cuda:
        torch.set_num_threads(s.threads)
    modes = tuple(m.strip() for m in args.modes.split(","))
    if not set(modes) <= {"fwd", "fwd_bwd"}:
        raise ValueError(f"--modes: expected a comma list of fwd, fwd_bwd, got {args.modes!r}.")
    if args.ops and args.plot:
        raise ValueError("--plot: plots the model-level fwd_bwd rows; the op-level run (--ops) has none.")
    t0 = time.perf_counter()
    if args.tree:
        from zorro_verl.bench.tree import check_tree_targets, format_tree_table, run_tree_bench

        rows = run_tree_bench(modes=modes, model_shape=s.model, dtype=DTYPES[s.dtype], device=s.device,
                              warmup=args.warmup, reps=args.reps, clock=s.clock,
                              backend=s.backends[0] if args.backends else "sdpa")
        checks = check_tree_targets(rows) if torch.device(s.device).type == "cpu" else []
        return _finish(rows, args.json, format_tree_table(rows), checks, "prefix-tree benchmark", s.device, t0)
    if args.ops:
        from zorro_verl.bench.ops import run_ops

        # every available backend unless named: comparing backends is what the op-level run is for
        rows = run_ops(s.scenarios, modes=modes, backends=list(s.backends) if args.backends else None,
                       model_shape=s.model, dtype=DTYPES[s.dtype], device=s.device, warmup=args.warmup,
                       reps=args.reps, clock=s.clock)
    else:
        from zorro_verl.bench.runner import run_bench

        rows = run_bench(s.scenarios, modes=modes, backends=s.backends, model_shape=s.model, dtype=DTYPES[s.dtype],
                         device=s.device, warmup=args.warmup, reps=args.reps, clock=s.clock, grad_ckpt=s.grad_ckpt,
                         baseline_rows=args.baseline_rows, full_logits=not args.no_full,
                         plan_scenario=s.plan_scenario, lora_rank=s.lora_rank)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.plot:
        plot(rows, args.plot)
    print()
    print(format_table(rows))
    checks = check_targets(rows, s.targets)
    for line in checks:
        print(line)
    print(f"total {time.perf_counter() - t0:.0f} s; preset {s.name}; device: {rows[0]['device'] if rows else s.device}")
    return 1 if any(c.startswith("FAIL") for c in checks) else 0
