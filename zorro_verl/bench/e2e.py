"""The e2e benchmark's analysis: verl's per-step ``timing_s/*`` of a stock and a zorro ``main_ppo`` run on identical
rollouts -> per-phase medians, speedups, the FLOP model's ideal for each phase's batch, efficiencies, the targets,
and the report (Markdown table, SVG bar plot). The runs themselves are launched by tests/e2e/bench.py
(scripts/bench_e2e.sh); nothing here starts a process.

The ideal of a phase is ``stock FLOPs / zorro FLOPs`` of the phase's batch (:mod:`zorro_verl.bench.flops`; a
backward costs twice its forward on both sides, so the ratio holds for the update too):

* stock = verl's remove-padding forward: every row's ``P + R`` tokens through the layers, causal attention within
  each row, the LM head on every token (the model's forward computes logits for the whole packed sequence);
* zorro = each unique prompt once per sharing unit (``sharing: prompt``; the prefix tree of the unit's rows for
  ``sharing: prefix``), every response against its prompt, the LM head on response tokens only. The sharing unit is
  what zorro can deduplicate over at best: the rank's whole batch for the forward-only passes (``old_log_prob``,
  ``ref``), each mini-batch of ``mini_batch`` whole groups for ``update_actor``.

A run with a critic (PPO with GAE) has two more phases zorro's value-head engine runs, ``values`` (forward-only, the
step's batch as one unit) and ``update_critic`` (units of the critic's mini-batches): the same FLOP model with the
value head's one output per token in place of the LM head (``vocab_size`` 1).

A measured speedup below the ideal is overhead (planning, micro-batching, data movement) or sharing lost to
micro-batch boundaries; above it, stock computing more than the FLOP model counts for it.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

from zorro_verl.bench.flops import flop_model, layer_costs, tree_flop_model
from zorro_verl.bench.report import cpu_model
from zorro_verl.packing import DEFAULT_MIN_SHARED_LEN

__all__ = ["PHASES", "ACTOR_PHASES", "CRITIC_PHASES", "ENGINE_PHASES", "AS_MEASURED", "TARGETS", "QUICK_TARGETS",
           "StepRows", "read_recording", "stock_flops", "zorro_flops", "value_model_config", "phase_ideals",
           "phase_table", "amdahl_speedup", "check_targets", "with_stock_generation",
           "format_markdown", "svg_plot", "machine", "matmul_rate", "write_docs_section", "DOCS_BEGIN", "DOCS_END"]

#: verl's ``timing_s/<phase>`` keys reported, in the table's order (verl's order within a step; ``step`` = the whole
#: training step). The critic's phases only where a run has them (PPO with GAE).
PHASES = ("gen", "old_log_prob", "ref", "values", "update_critic", "update_actor", "step")
#: The phases zorro's engine runs for the actor and reference.
ACTOR_PHASES = ("old_log_prob", "ref", "update_actor")
#: The phases zorro's value-head engine runs for the critic (absent from a run without one: left out of its table).
CRITIC_PHASES = ("values", "update_critic")
#: Every phase zorro runs (the rest it leaves to verl): those with an ideal, an efficiency and a target.
ENGINE_PHASES = ACTOR_PHASES + CRITIC_PHASES
#: The phases that do the same work in both runs and that zorro does not touch (vLLM answering the same requests),
#: but whose time swings from step to step (``gen``: +-30% on a 2-core machine): the whole step's ideal and target
#: take their time from the zorro run's row (its median, or fastest step), so that this noise cannot move the
#: step's target. (A replaying zorro run does not generate: its rows carry the stock run's ``gen`` of each step,
#: :func:`with_stock_generation`.)
AS_MEASURED = ("gen",)
#: ``efficiency``: measured / ideal speedup of each engine phase (:data:`ENGINE_PHASES`) whose ideal is >=
#: ``min_ideal``, and the whole
#: step's floor (Amdahl with those phase speedups); memory: zorro's peak heap in use of a training worker <= stock's
#: (peak RSS where glibc's ``mallinfo2`` is missing; tests/support/heap_peak.py says why not RSS).
#: ``stat``: how a phase's time is taken over the measured steps (``median``, or ``min``: the fastest step).
TARGETS = {"efficiency": 0.8, "min_ideal": 2.0, "stat": "median"}
#: The CI version (one warm-up and two measured steps on a busy 2-core machine): a looser efficiency bound, and each
#: phase's fastest measured step on both sides — with two steps the median is their mean, and one step slowed by the
#: host (measured: a prefix run's ``ref`` at 3.9 s in one step and 1.4 s in the next) would move it by half.
QUICK_TARGETS = {"efficiency": 0.6, "min_ideal": 2.0, "stat": "min",
                 # the known gap (docs/BENCHMARKS.md, "Where the time goes"): sharing=prefix's forward-only passes run
                 # at 0.36-0.76 of their ideal in CI's 8-layer bf16 runs on a Xeon, around the 0.6 bound; reported,
                 # not gated here (the full run checks them at 0.8: held in fp32 on an AVX2 CPU, missed in bf16 on
                 # the Xeon)
                 "unchecked": {"prefix": ("old_log_prob", "ref")}}
_STATS = {"median": statistics.median, "min": min}


@dataclass
class StepRows:
    """One training step's rows, in group order: ``groups[g]`` = ``(prompt_ids, [response_ids of each sample])``."""

    step: int
    groups: list

    def lengths(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``p_len [B] int64``, ``r_len [B] int64``, ``row_group [B] int64`` of the step's rows."""
        p, r, g = [], [], []
        for gi, (prompt, responses) in enumerate(self.groups):
            for resp in responses:
                p.append(len(prompt))
                r.append(len(resp))
                g.append(gi)
        return torch.tensor(p), torch.tensor(r), torch.tensor(g)


def _uid_number(uid: str) -> int:
    """Sequential uids (``uuid.UUID(int=k)``) and plain integers -> ``k``; anything else keeps its text order."""
    try:
        return int(uid.replace("-", ""), 16)
    except ValueError:
        return -1


def read_recording(path, prompts_per_step: int) -> list[StepRows]:
    """The rows of every step from a rollout recording (JSON lines ``{"key": "{uid}_{session}:{turn}",
    "prompt_ids": [...], "token_ids": [...]}``, tests/support/verl_cpu_e2e.py): requests grouped by ``uid``, uids in
    sequence order, ``prompts_per_step`` groups per step."""
    by_uid: dict[str, tuple[list, list]] = {}
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        uid_session, turn = rec["key"].rsplit(":", 1)
        uid, session = uid_session.rsplit("_", 1)
        if int(turn) != 0:
            raise ValueError(f"read_recording: multi-turn request {rec['key']} in {path}; the e2e benchmark's FLOP "
                             "model takes single-turn GRPO rows.")
        prompt = [int(t) for t in rec["prompt_ids"]]
        entry = by_uid.setdefault(uid, (prompt, []))
        if entry[0] != prompt:
            raise ValueError(f"read_recording: uid {uid} has two different prompts in {path}.")
        entry[1].append((int(session), [int(t) for t in rec["token_ids"]]))
    uids = sorted(by_uid, key=lambda u: (_uid_number(u), u))
    steps = []
    for s in range(0, len(uids), prompts_per_step):
        chunk = uids[s:s + prompts_per_step]
        groups = [(by_uid[u][0], [t for _, t in sorted(by_uid[u][1], key=lambda x: x[0])]) for u in chunk]
        steps.append(StepRows(step=s // prompts_per_step + 1, groups=groups))
    return steps


def stock_flops(cfg, p_len: torch.Tensor, r_len: torch.Tensor) -> int:
    """Forward FLOPs of verl's remove-padding forward of these rows (``[B] int64`` lengths): ``P + R`` tokens per row
    through every layer, causal attention within the row, logits on every token."""
    L, per_token, per_pair = layer_costs(cfg)
    t = p_len + r_len
    tokens, pairs = int(t.sum()), int((t * (t + 1) // 2).sum())
    return per_token * tokens + L * per_pair * pairs + 2 * cfg.hidden_size * cfg.vocab_size * tokens


def zorro_flops(cfg, groups: Sequence, sharing: str = "prompt", min_shared_len: int = DEFAULT_MIN_SHARED_LEN) -> int:
    """Forward FLOPs of zorro's deduplicated forward of ``groups`` (``(prompt_ids, [response_ids...])``) computed as
    one unit: each prompt once (``sharing="prompt"``), or the prefix tree of all rows (``"prefix"``)."""
    if sharing == "prompt":
        p, r, g = StepRows(0, list(groups)).lengths()
        S = int((p + r).max())
        return flop_model(cfg, p, r, g, S)["zorro"]
    if sharing != "prefix":
        raise ValueError(f"sharing: expected 'prompt' or 'prefix', got {sharing!r}.")
    from zorro_verl.packing.plan import build_tree_plan
    from zorro_verl.testing import batch_from_rows

    b = batch_from_rows([(prompt, resp) for prompt, responses in groups for resp in responses])
    plan = build_tree_plan(b["input_ids"], b["attention_mask"], b["responses"].shape[1], min_shared_len=min_shared_len)
    return tree_flop_model(cfg, plan)["zorro"]


def value_model_config(cfg):
    """A copy of the (language) model config ``cfg`` whose head is a value head: one output per token
    (``vocab_size`` 1; verl's critic is ``AutoModelForTokenClassification`` with ``num_labels = 1``), for the FLOP
    model of the critic's phases."""
    import copy

    out = copy.deepcopy(cfg)
    out.vocab_size = 1
    return out


def _ratios(cfg, steps: Sequence[StepRows], sharing: str, mini_batch: int, min_shared_len: int) -> tuple:
    """``(forward ideal, update ideal)`` of ``steps``: the step's batch as one unit, and units of ``mini_batch``
    groups."""
    s_tot = z_fwd = z_upd = 0
    for st in steps:
        p, r, _ = st.lengths()
        s_tot += stock_flops(cfg, p, r)
        z_fwd += zorro_flops(cfg, st.groups, sharing, min_shared_len)
        z_upd += sum(zorro_flops(cfg, st.groups[i:i + mini_batch], sharing, min_shared_len)
                     for i in range(0, len(st.groups), mini_batch))
    return s_tot / z_fwd, s_tot / z_upd


def phase_ideals(cfg, steps: Sequence[StepRows], *, sharing: str, mini_batch: int,
                 min_shared_len: int = DEFAULT_MIN_SHARED_LEN, critic_mini_batch: Optional[int] = None) -> dict:
    """``{phase: ideal speedup}`` for ``old_log_prob``, ``ref`` (the step's batch as one unit) and ``update_actor``
    (units of ``mini_batch`` groups), summed over ``steps``; with ``critic_mini_batch`` (groups per critic
    mini-batch: a run with a critic) also ``values`` and ``update_critic``, on :func:`value_model_config`."""
    fwd, upd = _ratios(cfg, steps, sharing, mini_batch, min_shared_len)
    out = {"old_log_prob": fwd, "ref": fwd, "update_actor": upd}
    if critic_mini_batch is not None:
        out["values"], out["update_critic"] = _ratios(value_model_config(cfg), steps, sharing, critic_mini_batch,
                                                      min_shared_len)
    return out


def _stat(steps: dict, phase: str, warmup: int, stat: str = "median") -> tuple[Optional[float], list[float]]:
    vals = [m[f"timing_s/{phase}"] for s, m in sorted(steps.items()) if s > warmup and f"timing_s/{phase}" in m]
    return (_STATS[stat](vals) if vals else None), vals


def amdahl_speedup(stock_times: dict, phase_speedups: dict, total: str = "step",
                   measured: Optional[dict] = None) -> float:
    """Whole-step speedup when each phase ``p`` of ``phase_speedups`` gets ``phase_speedups[p]`` times faster, each
    phase ``q`` of ``measured`` takes ``measured[q]`` seconds (its time in the other run) and the rest of
    ``stock_times[total]`` stays: ``T / (T - sum T_p - sum T_q + sum T_p / s_p + sum M_q)``."""
    T = stock_times[total]
    measured = measured or {}
    rest = T - sum(stock_times[p] for p in phase_speedups) - sum(stock_times[q] for q in measured)
    return T / (rest + sum(stock_times[p] / s for p, s in phase_speedups.items()) + sum(measured.values()))


def with_stock_generation(stock_steps: dict, zorro_steps: dict) -> dict:
    """A replaying run's steps (``{step: {metric: value}}``) with the stock run's generation of the same step in place
    of its own: a run that answers every rollout request from the stock run's recording does not generate, so its
    ``timing_s/gen`` is only the wait for the replay buffer. Its ``timing_s/step`` gets the difference, so that the
    step row compares the same generation (vLLM answering the same requests, which zorro does not touch) on both
    sides. Steps without a ``gen`` / ``step`` time on either side are left as they are. Returns new dicts."""
    out = {}
    for step, m in zorro_steps.items():
        m = dict(m)
        g_stock = stock_steps.get(step, {}).get("timing_s/gen")
        if g_stock is not None and "timing_s/gen" in m and "timing_s/step" in m:
            m["timing_s/step"] += g_stock - m["timing_s/gen"]
            m["timing_s/gen"] = g_stock
        out[step] = m
    return out


def phase_table(stock_steps: dict, zorro_steps: dict, ideals: dict, *, warmup: int,
                targets: dict = TARGETS, unchecked: Sequence[str] = ()) -> list[dict]:
    """One row per phase of :data:`PHASES` (the critic's, :data:`CRITIC_PHASES`, only where either run has them):
    ``stock_s``, ``zorro_s`` (medians of the steps after ``warmup``, or
    their minimum with ``targets["stat"] == "min"``),
    ``speedup`` = stock / zorro, ``ideal`` and ``efficiency`` = speedup / ideal (engine phases), ``target`` (the
    least speedup the targets ask for) and ``n`` (measured steps). The ``step`` row's ideal is Amdahl's law with each
    engine phase at its ideal; its target Amdahl's with each engine phase at ``efficiency x ideal`` where that ideal is
    >= ``min_ideal`` (else 1); both from the stock run's medians, except the phases of :data:`AS_MEASURED`, which
    take the zorro run's. Phases in ``unchecked`` get no target (``target`` None, ``unchecked`` True) and enter the
    step's floor unsped (1x)."""
    rows, med_s = [], {}
    for ph in PHASES:
        stat = targets.get("stat", "median")
        s, sv = _stat(stock_steps, ph, warmup, stat)
        z, zv = _stat(zorro_steps, ph, warmup, stat)
        if ph in CRITIC_PHASES and not sv and not zv:
            continue  # no critic in these runs
        med_s[ph] = s
        row = {"phase": ph, "stock_s": s, "zorro_s": z, "n": min(len(sv), len(zv)), "stat": stat,
               "speedup": (s / z) if s and z else None, "ideal": ideals.get(ph), "efficiency": None, "target": None}
        if row["ideal"] and row["speedup"]:
            row["efficiency"] = row["speedup"] / row["ideal"]
            if row["ideal"] >= targets["min_ideal"] and ph not in unchecked:
                row["target"] = targets["efficiency"] * row["ideal"]
        row["unchecked"] = ph in unchecked
        rows.append(row)
    present = [p for p in ENGINE_PHASES if med_s.get(p) and ideals.get(p)]
    if med_s.get("step") and present:
        step = next(r for r in rows if r["phase"] == "step")
        same = {r["phase"]: r["zorro_s"] for r in rows if r["phase"] in AS_MEASURED and r["stock_s"] and r["zorro_s"]}
        step["ideal"] = amdahl_speedup(med_s, {p: ideals[p] for p in present}, measured=same)
        floor = {p: targets["efficiency"] * ideals[p] if ideals[p] >= targets["min_ideal"] and p not in unchecked
                 else 1.0 for p in present}
        step["target"] = amdahl_speedup(med_s, floor, measured=same)
        if step["speedup"]:
            step["efficiency"] = step["speedup"] / step["ideal"]
    return rows


def check_targets(rows: list[dict], stock_peak_gb: Optional[float] = None,
                  zorro_peak_gb: Optional[float] = None, memory: str = "peak RSS") -> list[str]:
    """The missed targets, as sentences (empty when all hold): each row's ``speedup >= target`` (engine phases and the
    whole step), and ``zorro_peak_gb <= stock_peak_gb`` (a training worker's peak of ``memory``: RSS, or the heap in
    use) when both are given."""
    missed = []
    for r in rows:
        if r["target"] is None:
            continue
        if r["speedup"] is None or r["speedup"] < r["target"]:
            missed.append(f"{r['phase']}: speedup {r['speedup'] or 0:.2f}x < target {r['target']:.2f}x "
                          f"(ideal {r['ideal']:.2f}x)")
    if stock_peak_gb is not None and zorro_peak_gb is not None and zorro_peak_gb > stock_peak_gb:
        missed.append(f"memory: zorro's training worker's {memory} peaked at {zorro_peak_gb:.3f} GiB > stock's "
                      f"{stock_peak_gb:.3f} GiB")
    return missed


def _f(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def format_markdown(tables: dict, roles: dict, meta: dict, heap: Optional[dict] = None) -> str:
    """The report: one phase table per zorro run (``tables``: run name -> :func:`phase_table` rows), the peak RSS per
    process role of every run (``roles``: run -> {role: GiB}), the training worker's peak heap in use per run
    (``heap``: run -> GiB, when measured), and ``meta`` (command, machine, sha, settings)."""
    out = []
    for name, rows in tables.items():
        how = "medians" if rows[0].get("stat", "median") == "median" else "the fastest"
        out.append(f"**{name} vs stock** ({how} of {rows[0]['n']} measured steps)\n")
        out.append("| phase | stock s | zorro s | speedup | ideal | efficiency | target |")
        out.append("|---|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            target = _f(r["target"], ".2f") + "x" if r["target"] else ("unchecked" if r.get("unchecked") else "-")
            out.append(f"| {r['phase']} | {_f(r['stock_s'], '.2f')} | {_f(r['zorro_s'], '.2f')} | "
                       f"{_f(r['speedup'], '.2f')}x | {_f(r['ideal'], '.2f')}x | {_f(r['efficiency'], '.2f')} | "
                       f"{target} |")
        out.append("")
    all_roles = sorted({k for v in roles.values() for k in v})
    out.append("**Peak RSS per process (GiB)**, largest process of each role\n")
    out.append("| role | " + " | ".join(roles) + " |")
    out.append("|---|" + "---:|" * len(roles))
    for role in all_roles:
        out.append(f"| {role} | " + " | ".join(_f(roles[n].get(role), ".2f") for n in roles) + " |")
    out.append("")
    if heap:
        out.append("**Peak C heap in use of the training worker (GiB)** (glibc ``mallinfo2``, sampled every 2 ms: "
                   "the bytes malloc has handed out, whatever it keeps resident)\n")
        out.append("| | " + " | ".join(heap) + " |")
        out.append("|---|" + "---:|" * len(heap))
        out.append("| train worker | " + " | ".join(_f(v, ".3f") for v in heap.values()) + " |")
        out.append("")
    for k, v in meta.items():
        out.append(f"- {k}: {v}")
    return "\n".join(out) + "\n"


def svg_plot(tables: dict, path, title: str = "") -> None:
    """Per-phase bars (median seconds): stock and each zorro run of ``tables``, with the ideal (stock / ideal
    speedup) marked on each zorro bar as a black tick. Plain SVG, no plotting library."""
    phases = [r["phase"] for r in next(iter(tables.values()))]
    series = [("stock", "#8c8c8c", [r["stock_s"] for r in next(iter(tables.values()))], None)]
    colors = ["#1f77b4", "#2ca02c", "#d62728", "#9467bd"]
    for i, (name, rows) in enumerate(tables.items()):
        series.append((name, colors[i % len(colors)], [r["zorro_s"] for r in rows],
                       [r["stock_s"] / r["ideal"] if r["ideal"] and r["stock_s"] else None for r in rows]))
    top = max((v for _, _, vals, _ in series for v in vals if v), default=1.0) * 1.1
    W, H, left, bottom, topm = 760, 360, 60, 50, 40
    ph_w = (W - left - 20) / len(phases)
    bar_w = ph_w * 0.8 / len(series)
    y = lambda v: topm + (H - topm - bottom) * (1 - v / top)  # noqa: E731
    el = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" '
          f'font-size="11">', f'<rect width="{W}" height="{H}" fill="white"/>',
          f'<text x="{W / 2}" y="18" text-anchor="middle" font-size="13">{_esc(title)}</text>']
    for k in range(6):  # y grid
        v = top * k / 5
        el.append(f'<line x1="{left}" x2="{W - 20}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#ddd"/>')
        el.append(f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.1f}</text>')
    el.append(f'<text x="14" y="{(H - bottom + topm) / 2}" transform="rotate(-90 14 {(H - bottom + topm) / 2})" '
              'text-anchor="middle">median seconds per step</text>')
    for i, ph in enumerate(phases):
        x0 = left + i * ph_w + ph_w * 0.1
        for j, (_, color, vals, ideal) in enumerate(series):
            v = vals[i]
            if v is None:
                continue
            x = x0 + j * bar_w
            el.append(f'<rect x="{x:.1f}" y="{y(v):.1f}" width="{bar_w * 0.9:.1f}" height="{y(0) - y(v):.1f}" '
                      f'fill="{color}"/>')
            if ideal and ideal[i] is not None:
                el.append(f'<line x1="{x - 2:.1f}" x2="{x + bar_w * 0.9 + 2:.1f}" y1="{y(ideal[i]):.1f}" '
                          f'y2="{y(ideal[i]):.1f}" stroke="black" stroke-width="2"/>')
        el.append(f'<text x="{left + (i + 0.5) * ph_w:.1f}" y="{H - bottom + 16}" text-anchor="middle">{ph}</text>')
    lx = left
    for name, color, _, _ in series:
        el.append(f'<rect x="{lx}" y="{H - 18}" width="10" height="10" fill="{color}"/>')
        el.append(f'<text x="{lx + 14}" y="{H - 9}">{_esc(name)}</text>')
        lx += 24 + 7 * len(name)
    el.append(f'<line x1="{lx}" x2="{lx + 14}" y1="{H - 13}" y2="{H - 13}" stroke="black" stroke-width="2"/>')
    el.append(f'<text x="{lx + 18}" y="{H - 9}">ideal (FLOP model)</text>')
    el.append("</svg>")
    Path(path).write_text("\n".join(el) + "\n")


def _esc(s: str) -> str:
    return str(s).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def machine(gpu: bool = False) -> str:
    """The CPU model and core count of this host (the e2e runs' processes share its cores); with ``gpu``, the first
    CUDA device's name first."""
    import os

    if gpu and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} (host: {machine()})"
    return f"{cpu_model()}, {os.cpu_count()} cores"


def matmul_rate(dtype: torch.dtype, threads: int, seconds: float = 0.3) -> float:
    """GFLOP/s of this CPU on the benchmark model's MLP matmul (``[4096, 512] x [512, 1536]``) in ``dtype`` with
    ``threads`` intra-op threads, the best of repeated calls for about ``seconds``. CPUs without native bf16 units
    (AVX2 only: no AVX-512 BF16 / AMX) run bf16 matmuls several times slower than fp32 ones."""
    import time

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.randn(4096, 512).to(dtype)
        w = torch.randn(1536, 512).to(dtype)
        torch.nn.functional.linear(a, w)
        best, end = float("inf"), time.perf_counter() + seconds
        while time.perf_counter() < end:
            t = time.perf_counter()
            torch.nn.functional.linear(a, w)
            best = min(best, time.perf_counter() - t)
    finally:
        torch.set_num_threads(old)
    return 2 * 4096 * 512 * 1536 / best / 1e9


#: docs/BENCHMARKS.md's e2e section lies between these two lines (rewritten by ``--docs``).
DOCS_BEGIN = "<!-- bench_e2e:begin (written by scripts/bench_e2e.sh --docs) -->"
DOCS_END = "<!-- bench_e2e:end -->"


def write_docs_section(doc_path, report_md: str, svg_dest, svg_src) -> None:
    """Replace the text between :data:`DOCS_BEGIN` and :data:`DOCS_END` in ``doc_path`` by ``report_md`` and the plot
    (``svg_src`` copied to ``svg_dest``, linked relative to the document)."""
    import shutil

    doc_path, svg_dest = Path(doc_path), Path(svg_dest)
    text = doc_path.read_text()
    if DOCS_BEGIN not in text or DOCS_END not in text:
        raise ValueError(f"{doc_path}: expected the markers {DOCS_BEGIN!r} and {DOCS_END!r} around the e2e section.")
    shutil.copyfile(svg_src, svg_dest)
    rel = svg_dest.relative_to(doc_path.parent) if svg_dest.is_relative_to(doc_path.parent) else svg_dest
    body = f"{report_md}\n![per-phase median seconds, stock vs zorro, ideal marked]({rel})\n"
    head, rest = text.split(DOCS_BEGIN, 1)
    _, tail = rest.split(DOCS_END, 1)
    doc_path.write_text(f"{head}{DOCS_BEGIN}\n{body}{DOCS_END}{tail}")
