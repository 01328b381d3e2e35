"""Reporting: the text table, the PNG plot, the target checks, and the provenance every row records (library
versions, git sha, device name).

Rows are the dicts :func:`zorro_verl.bench.runner.run_bench` (model level; ``mode`` ``fwd`` / ``fwd_bwd`` /
``plan``) and :func:`zorro_verl.bench.ops.run_ops` (``bench == "ops"``) return; times in ms, memory in MiB.
"""

from __future__ import annotations

import os
import platform
import subprocess
from typing import Optional

import torch

from zorro_verl.bench.presets import Targets

__all__ = ["format_table", "plot", "check_targets", "versions", "git_sha", "device_name", "cpu_model"]


def versions() -> dict:
    """Python / torch / transformers / flash-attn versions (and the flash provider and CUDA version on CUDA)."""
    import transformers

    v = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    try:
        import flash_attn

        v["flash_attn"] = flash_attn.__version__
    except ImportError:
        v["flash_attn"] = None
    if torch.cuda.is_available():
        try:
            from zorro_verl.attention.primitives import flash_provider

            v["flash_provider"] = flash_provider()
        except ImportError:  # provenance only: never fail a run over it
            v["flash_provider"] = None
        v["cuda"] = torch.version.cuda
    return v


def git_sha() -> str:
    """Short sha of the checkout this package runs from, ``-dirty`` with uncommitted tracked changes."""
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=here, capture_output=True, text=True,
                             timeout=10)
        sha = out.stdout.strip() or "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU model with its core and torch thread counts."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu: {cpu_model()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads"


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what :mod:`platform` knows."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return name


def markdown_table(head: list[str], rows: list[list]) -> str:
    """A markdown table (the form docs/BENCHMARKS.md quotes): ``head`` the column names, ``rows`` the cells."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def logprob_check(r: dict, tol: float) -> tuple[bool, str]:
    """The fp32 exactness line of a benchmark row: ``(ok, "PASS|FAIL <scenario>: log-probs max |zorro - ordinary|
    ...")`` from its ``logprob_max_abs_diff``."""
    ok = r["logprob_max_abs_diff"] <= tol
    return ok, (f"{'PASS' if ok else 'FAIL'} {r['scenario']}: log-probs max |zorro - ordinary| "
                f"{r['logprob_max_abs_diff']:.1e} <= {tol:.0e} (fp32)")


def check_targets(rows: list[dict], targets: Optional[Targets]) -> list[str]:
    """The preset's targets on the rows given; returns a line per check ('PASS ...' / 'FAIL ...').

    Speedups are judged on ``speedup_paired``, the median over runs of baseline/zorro time of the two neighbouring
    (interleaved) runs: on a shared CPU host throughput drifts by tens of percent within seconds (the same matmul
    loop measured 333-540 ms here), which moves a ratio of two medians taken seconds apart but cancels in each
    pair. The ratio of medians is printed beside it. Op-level rows (``bench == "ops"``) have no targets."""
    if targets is None:
        return []
    t = targets
    out = []
    for r in rows:
        if r.get("bench") == "ops":
            continue
        if r["mode"] == "plan":
            if t.plan_fraction is not None:
                ok = r["plan_fraction"] <= t.plan_fraction
                out.append(f"{'PASS' if ok else 'FAIL'} plan building {100 * r['plan_fraction']:.2f}% <= "
                           f"{100 * t.plan_fraction:g}% of a fwd_bwd step ({r['scenario']}, B={r['B']}, G={r['G']})")
            continue
        if r["mode"] != "fwd_bwd" or r["baseline"] != "a2a":
            continue
        if r["G"] == r["B"]:
            if t.noshare_time is not None:
                ok = r["speedup_paired"] >= 1 / t.noshare_time
                out.append(f"{'PASS' if ok else 'FAIL'} no sharing: zorro/baseline time "
                           f"{1 / r['speedup_paired']:.3f} <= {t.noshare_time:g} (paired; ratio of medians "
                           f"{1 / r['speedup']:.3f}) ({r['scenario']}, {r['backend']})")
            continue
        if t.efficiency is None:
            continue
        if t.efficiency_shapes is not None:
            applies = (r["B"], r["G"], r["P"], r["R"]) in t.efficiency_shapes
        else:
            applies = r["P"] / r["R"] >= t.efficiency_min_pr and r["n"] >= t.efficiency_min_n
        if applies:
            ok = r["efficiency_paired"] >= t.efficiency
            out.append(f"{'PASS' if ok else 'FAIL'} efficiency {r['efficiency_paired']:.3f} >= {t.efficiency:g} "
                       f"(paired; ratio of medians {r['efficiency']:.3f}) ({r['scenario']}, "
                       f"P/R={r['P'] / r['R']:.0f}, n={r['n']:.0f}, {r['backend']})")
    return out


def _format_model_rows(rows: list[dict]) -> list[str]:
    lines = [f"{'scenario':>13} {'B':>3} {'G':>3} {'P':>5} {'R':>5} {'mode':>7} {'backend':>14} {'base':>4} "
             f"{'base ms':>9} {'zorro ms':>9} {'speedup':>7} {'ideal':>6} {'eff':>5} {'eff_p':>5} {'base MB':>8} "
             f"{'zorro MB':>8}"]
    for r in rows:
        if r["mode"] == "plan":
            lines.append(f"{r['scenario']:>13} {r['B']:>3} {r['G']:>3} {r['P']:>5} {r['R']:>5} {'plan':>7} "
                         f"{r['backend']:>14} {'':>4} {r['plan_ms']:9.2f} {r['zorro_ms']:9.1f} "
                         f"plan = {100 * r['plan_fraction']:.2f}% of the fwd_bwd step")
            continue
        lines.append(f"{r['scenario']:>13} {r['B']:>3} {r['G']:>3} {r['P']:>5} {r['R']:>5} {r['mode']:>7} "
                     f"{r['backend']:>14} {r['baseline']:>4} {r['baseline_ms']:9.1f} {r['zorro_ms']:9.1f} "
                     f"{r['speedup']:7.2f} {r['ideal_speedup']:6.2f} {r['efficiency']:5.2f} "
                     f"{r['efficiency_paired']:5.2f} {r['baseline_peak_mb']:8.0f} {r['zorro_peak_mb']:8.0f}")
    return lines


def _format_ops_rows(rows: list[dict]) -> list[str]:
    lines = ["attention op (one layer's attend vs the ordinary per-row SDPA; ratio = zorro / ordinary time):",
             f"{'scenario':>9} {'B':>3} {'G':>3} {'P':>5} {'R':>5} {'mode':>7} {'backend':>14} {'ord ms':>9} "
             f"{'zorro ms':>9} {'ratio':>6} {'ratio_p':>7} {'ideal':>6} {'eff':>5} {'ord MB':>8} {'zorro MB':>8} "
             f"{'max|diff|':>9}"]
    for r in rows:
        lines.append(f"{r['scenario']:>9} {r['B']:>3} {r['G']:>3} {r['P']:>5} {r['R']:>5} {r['mode']:>7} "
                     f"{r['backend']:>14} {r['ordinary_ms']:9.2f} {r['ms']:9.2f} {r['ratio']:6.3f} "
                     f"{r['ratio_paired']:7.3f} {r['ideal_speedup']:6.2f} {r['efficiency']:5.2f} "
                     f"{r['ordinary_peak_mb']:8.0f} {r['peak_mb']:8.0f} {r['max_abs_diff']:9.1e}")
    return lines


def format_table(rows: list[dict]) -> str:
    """The text table: model-level rows (and the plan check), then op-level rows under their own header."""
    model_rows = [r for r in rows if r.get("bench") != "ops"]
    ops_rows = [r for r in rows if r.get("bench") == "ops"]
    lines = _format_model_rows(model_rows) if model_rows or not ops_rows else []
    if ops_rows:
        lines += ([""] if lines else []) + _format_ops_rows(ops_rows)
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    """PNG: fwd_bwd speedup (measured, per backend) and ideal vs P/R (left) and vs group size n (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = [r for r in rows if r["mode"] == "fwd_bwd" and r["baseline"] == "a2a"]
    if not data:
        raise ValueError("--plot: no fwd_bwd rows against the a2a baseline to plot (run mode fwd_bwd).")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    backends = sorted({r["backend"] for r in data})
    for ax, key, label in ((axes[0], lambda r: r["P"] / r["R"], "prompt / response length (P/R)"),
                           (axes[1], lambda r: r["n"], "group size n = B/G")):
        seen = set()
        for r in data:
            x = key(r)
            if (x, r["scenario"]) not in seen:
                seen.add((x, r["scenario"]))
                ax.scatter(x, r["ideal_speedup"], marker="_", s=400, color="k",
                           label="ideal (FLOP model)" if len(seen) == 1 else None)
        for i, be in enumerate(backends):
            pts = [(key(r), r["speedup"], r["scenario"]) for r in data if r["backend"] == be]
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], marker="o", s=36, color=f"C{i}",
                       label=f"measured, zorro {be}")
            for x, y, name in pts:
                ax.annotate(name, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.set_xlabel(label)
        ax.set_ylabel("fwd_bwd speedup vs ordinary forward (a2a)")
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    r0 = data[0]
    fig.suptitle(f"zorro_verl: measured vs ideal speedup — {r0['model']} model, {r0['dtype']}, {r0['device']}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
