"""The prefix-tree benchmark: agentic-shaped batches, the ordinary forward vs zorro with prompt-only sharing vs
zorro with the prefix tree (``sharing=prefix``), against the FLOP model's ideal for the tree (docs/design/math.md).

Scenarios (CPU quick set, lengths scaled down 8x from the agentic shapes they stand for):

* ``system``: 32 rows = 8 questions x 4 samples behind one shared system prompt (2K tokens of tool
  specifications -> 256): prompt-only sharing shares each question's prompt; the tree also the system prompt.
* ``turns``: 4 trajectories of 4 turns, each emitted as 4 samples (verl's multi-output agent loop: output i > 0
  carries the conversation so far, tool observations masked): no two prompts are equal, the tree shares them all.
* ``grpo``: plain GRPO (2 prompts x 4 responses, P/R = 8): the tree adds nothing; prefix must cost what prompt
  sharing costs.

Per scenario and mode (``fwd``, ``fwd_bwd``), interleaved run by run on rotated batches: ``a2a`` (the ordinary
padded forward with the response-only head), ``prompt`` and ``prefix`` (plan building + zorro step, ``sdpa``).
Rows record the medians, the paired ratios and ``ideal_speedup`` (FLOP model) of each zorro variant vs ``a2a``,
and ``prefix_vs_prompt`` (paired time ratio). Targets (:data:`TREE_TARGETS`): fwd_bwd efficiency of ``prefix``
>= 0.85 where its ideal is >= 2x; ``prefix`` time <= 1.05x ``prompt`` where the tree adds nothing.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from zorro_verl.bench.flops import flop_model, tree_flop_model
from zorro_verl.bench.models import build_model
from zorro_verl.bench.report import markdown_table
from zorro_verl.bench.runner import Runner, common_fields, setup_run
from zorro_verl.bench.timing import Clock, time_interleaved

__all__ = ["TreeScenario", "TREE_SCENARIOS", "TREE_TARGETS", "tree_batches", "run_tree_bench", "check_tree_targets",
           "format_tree_table"]

VOCAB = 4000


@dataclass(frozen=True)
class TreeScenario:
    """One agentic batch shape: ``kind`` ``system`` (``a`` questions x ``b`` samples behind a ``c``-token system
    prompt, ``d``-token questions, ``e``-token responses), ``turns`` (``a`` trajectories of ``b`` turns, first
    prompt ``c``, turns of ``d`` tokens followed by ``e``-token tool observations) or ``grpo`` (``a`` prompts x
    ``b`` responses, prompt ``c``, response ``d``)."""

    name: str
    kind: str
    a: int
    b: int
    c: int
    d: int
    e: int = 0


TREE_SCENARIOS = (
    TreeScenario("system", "system", 8, 4, 256, 32, 32),
    TreeScenario("turns", "turns", 4, 4, 128, 32, 32),
    TreeScenario("grpo", "grpo", 2, 4, 256, 32),
)
#: ``efficiency``: fwd_bwd ``prefix`` efficiency (paired) where ``ideal >= min_ideal``; ``no_gain_time``: ``prefix``
#: / ``prompt`` time (paired) where the tree computes no fewer tokens than prompt sharing.
TREE_TARGETS = {"efficiency": 0.85, "min_ideal": 2.0, "no_gain_time": 1.05}


def _rows(sc: TreeScenario, seed: int):
    from zorro_verl.testing import multi_turn_rows, shared_system_rows

    if sc.kind == "system":
        rows = shared_system_rows(sc.a, sc.b, sc.c, sc.d, sc.e, vocab_size=VOCAB, seed=seed)
        return rows, None
    if sc.kind == "turns":
        return multi_turn_rows(sc.b, sc.c, sc.d, sc.e, trajectories=sc.a, vocab_size=VOCAB, seed=seed)
    if sc.kind == "grpo":
        gen = torch.Generator().manual_seed(seed)
        rnd = lambda n: torch.randint(1, VOCAB, (n,), generator=gen).tolist()  # noqa: E731
        rows = []
        for _ in range(sc.a):
            p = rnd(sc.c)
            rows += [(p, rnd(sc.d)) for _ in range(sc.b)]
        return rows, None
    raise ValueError(f"TreeScenario.kind: expected system, turns or grpo, got {sc.kind!r}.")


def tree_batches(sc: TreeScenario, k: int, device: str) -> list[dict]:
    """``k`` batches of one scenario: the same shape, different token ids and row orders."""
    from zorro_verl.testing import batch_from_rows

    out = []
    for i in range(k):
        rows, masks = _rows(sc, seed=1000 + i)
        perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(i)).tolist()
        out.append(batch_from_rows([rows[j] for j in perm], device=device,
                                   response_masks=None if masks is None else [masks[j] for j in perm]))
    return out


def _plan(batch, sharing: str):
    from zorro_verl.packing import build_plan

    return build_plan(batch["input_ids"], batch["attention_mask"], batch["responses"].shape[1], sharing=sharing)


def run_tree_bench(scenarios=TREE_SCENARIOS, *, modes=("fwd", "fwd_bwd"), model_shape="quick",
                   dtype=torch.float32, device="cpu", warmup=1, reps=5, clock="cpu", backend="sdpa",
                   log=print) -> list[dict]:
    """Run the grid; one row per (scenario, mode) with every variant's figures (see the module docstring);
    ``backend``: the zorro attention backend of both zorro variants (e.g. ``flash`` on CUDA)."""
    dev, _ = setup_run(reps, device, [backend])
    model = build_model(model_shape, dtype, device)
    model.train()
    ck = Clock(clock, dev.type == "cuda")
    runner = Runner(model, False, None)
    common = common_fields(dev, dtype, model_shape, clock, reps, warmup, False)
    rows = []
    for sc in scenarios:
        batches = tree_batches(sc, 3, device)
        fl = {"a2a": 0.0, "prompt": 0.0, "prefix": 0.0, "prompt_tokens": 0, "prefix_tokens": 0, "tokens": 0}
        for i in range(warmup, warmup + reps):  # FLOPs of exactly the batches the timed runs use
            bt = batches[i % len(batches)]
            pp, tp = _plan(bt, "prompt"), _plan(bt, "prefix")
            f = flop_model(model.config, pp.row_prompt_lens.cpu(), pp.response_lens.cpu(), pp.row_group.cpu(),
                           bt["input_ids"].shape[1])
            fl["a2a"] += f["baseline"] / reps
            fl["prompt"] += f["zorro"] / reps
            fl["prefix"] += tree_flop_model(model.config, tp)["zorro"] / reps
            fl["prompt_tokens"], fl["prefix_tokens"], fl["tokens"] = pp.T, tp.T, pp.ordinary_tokens
            depth = tp.tree.levels
        with torch.no_grad():  # sanity: the three agree on the first batch (recorded, not asserted)
            runner.use_baseline()
            ref = runner.baseline(batches[0], "fwd", full_logits=False)
            runner.use_zorro()
            diff = max(float((runner.zorro(batches[0], "fwd", backend, s) - ref).abs() / ref.abs()) for s in
                       ("prompt", "prefix"))
        for mode in modes:
            variants = {"a2a": (runner.use_baseline, lambda b, m=mode: runner.baseline(b, m, False)),
                        "prompt": (runner.use_zorro, lambda b, m=mode: runner.zorro(b, m, backend, "prompt")),
                        "prefix": (runner.use_zorro, lambda b, m=mode: runner.zorro(b, m, backend, "prefix"))}
            times, peak, method = time_interleaved(variants, batches, warmup, reps, ck, runner.reset, dev)
            med = {k: statistics.median(v) for k, v in times.items()}
            paired = lambda a, b, t=times: statistics.median(x / y for x, y in zip(t[a], t[b]))  # noqa: E731
            row = {"scenario": sc.name, "kind": sc.kind, "B": batches[0]["input_ids"].shape[0], "mode": mode,
                   "backend": backend,
                   "tree_depth": depth, "ordinary_tokens": fl["tokens"], "prompt_tokens": fl["prompt_tokens"],
                   "prefix_tokens": fl["prefix_tokens"], "a2a_ms": med["a2a"], "prompt_ms": med["prompt"],
                   "prefix_ms": med["prefix"], "runs_ms": times, "peak_mb": peak, "mem_method": method,
                   "logprob_sum_rel_diff": diff, **common}
            for z in ("prompt", "prefix"):
                ideal = fl["a2a"] / fl[z]
                row[f"{z}_ideal"] = ideal
                row[f"{z}_speedup"] = med["a2a"] / med[z]
                row[f"{z}_speedup_paired"] = paired("a2a", z)
                row[f"{z}_efficiency_paired"] = row[f"{z}_speedup_paired"] / ideal
            row["prefix_vs_prompt"] = paired("prefix", "prompt")
            rows.append(row)
            log(f"{sc.name:>7} {mode:>7}: a2a {med['a2a']:8.1f} ms  prompt {med['prompt']:8.1f} ms "
                f"(x{row['prompt_speedup_paired']:.2f}, ideal {row['prompt_ideal']:.2f})  prefix "
                f"{med['prefix']:8.1f} ms (x{row['prefix_speedup_paired']:.2f}, ideal {row['prefix_ideal']:.2f}, "
                f"eff {row['prefix_efficiency_paired']:.2f})  prefix/prompt {row['prefix_vs_prompt']:.3f}")
    return rows


def check_tree_targets(rows: list[dict], targets: dict = TREE_TARGETS) -> list[str]:
    """``PASS`` / ``FAIL`` lines for the fwd_bwd rows (see :data:`TREE_TARGETS`)."""
    out = []
    for r in rows:
        if r["mode"] != "fwd_bwd":
            continue
        if r["prefix_ideal"] >= targets["min_ideal"]:
            ok = r["prefix_efficiency_paired"] >= targets["efficiency"]
            out.append(f"{'PASS' if ok else 'FAIL'} {r['scenario']}: prefix efficiency "
                       f"{r['prefix_efficiency_paired']:.2f} >= {targets['efficiency']} "
                       f"(ideal {r['prefix_ideal']:.2f})")
        if r["prefix_tokens"] >= r["prompt_tokens"]:
            ok = r["prefix_vs_prompt"] <= targets["no_gain_time"]
            out.append(f"{'PASS' if ok else 'FAIL'} {r['scenario']}: prefix / prompt time "
                       f"{r['prefix_vs_prompt']:.3f} <= {targets['no_gain_time']} (the tree adds nothing here)")
    return out


def format_tree_table(rows: list[dict]) -> str:
    """A markdown table of the rows (the form docs/BENCHMARKS.md quotes)."""
    head = ["scenario", "mode", "B", "depth", "tokens ordinary / prompt / prefix", "a2a ms", "prompt ms (x, ideal)",
            "prefix ms (x, ideal, eff)", "prefix/prompt"]
    return markdown_table(head, [
        [r["scenario"], r["mode"], r["B"], r["tree_depth"],
         f"{r['ordinary_tokens']} / {r['prompt_tokens']} / {r['prefix_tokens']}", f"{r['a2a_ms']:.0f}",
         f"{r['prompt_ms']:.0f} (x{r['prompt_speedup_paired']:.2f}, {r['prompt_ideal']:.2f})",
         f"{r['prefix_ms']:.0f} (x{r['prefix_speedup_paired']:.2f}, {r['prefix_ideal']:.2f}, "
         f"{r['prefix_efficiency_paired']:.2f})", f"{r['prefix_vs_prompt']:.3f}"] for r in rows])
