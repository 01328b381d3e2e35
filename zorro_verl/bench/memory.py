"""Attention memory: the bytes one layer's attention keeps for backward, per backend vs stock, at one token budget.

The rule it checks (docs/DESIGN.md §2): zorro never keeps more bytes for backward than the stock path it replaces,
in the dtype users train in (bf16). A zorro micro-batch is filled to the same ``ppo_max_token_len_per_gpu`` as a
stock one, but its budget counts each prompt once, so it holds more rows; what matters is what a micro-batch keeps.

Per scenario ``(G, n, P, R, Hq, Hkv, D)``:

* the budget is the stock micro-batch's tokens, ``G * n * (P + R)``;
* stock: ``B = G * n`` rows of ``P + R`` tokens through the stock flash path — one varlen causal call over the
  rows (verl's remove-padding ``flash_attention_2``): ``q [B(P+R), Hq, D]``, ``k/v [B(P+R), Hkv, D]``;
* zorro: the first micro-batch :func:`~zorro_verl.packing.microbatch.dynamic_microbatches` fills from a pool of
  such groups (cost ``P + n R`` each), its plan, and the backend's ``attend`` on the packed row.

``q/k/v`` are bf16 leaves (``requires_grad``). Counted: every tensor autograd saves meanwhile
(``torch.autograd.graph.saved_tensors_hooks``) and every tensor a custom autograd Function keeps on its ``ctx``
(a kernel's state), deduplicated by storage, each storage counted whole. Floating storages are the layer's
activations (``saved_mib``); integer ones (``index_mib``) are the plan's index set, built once per micro-batch and
shared by every layer, the stock call's ``cu_seqlens`` and kernel RNG states.

Kernels: on CPU the ``flash`` / ``flash_copyfree`` backends and the stock call run their GPU index logic (the same
gathers, autograd Functions and saved tensors) over :func:`gpu_standin_primitives` — the plain-torch varlen math,
with the state the GPU providers keep beside it; the other backends run their own CPU kernels (``sdpa`` then saves
what CPU SDPA saves, which may differ from CUDA's). ``flex`` has no CPU backward and is not measured there. On CUDA
every backend runs its real kernels, and the run also times forward + backward (median) and records the peak of
``torch.cuda.max_memory_allocated`` over the step.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable, Optional

import torch

__all__ = ["MemScenario", "MEMORY_SCENARIOS", "parse_memory_scenario", "gpu_standin_primitives", "saved_bytes",
           "zorro_microbatch", "zorro_inputs", "run_memory", "format_memory_table", "check_memory_rule", "STOCK"]

#: The baseline's name in the rows.
STOCK = "stock"


@dataclass(frozen=True)
class MemScenario:
    """``G`` prompts of ``P`` tokens, ``n`` responses of ``R`` tokens each (the stock micro-batch: ``G n`` rows);
    ``Hq`` query heads, ``Hkv`` key/value heads of ``D`` channels."""

    name: str
    G: int
    n: int
    P: int
    R: int
    Hq: int
    Hkv: int
    D: int

    @property
    def budget(self) -> int:
        """The token budget: the stock micro-batch's tokens ``G n (P + R)``."""
        return self.G * self.n * (self.P + self.R)


#: Default scenarios: GRPO with GQA 4:1 (Qwen3-shaped heads of 128), longer responses, and MHA.
MEMORY_SCENARIOS = (
    MemScenario("gqa", 2, 8, 512, 64, 16, 4, 128),
    MemScenario("gqa-longresp", 2, 8, 512, 512, 16, 4, 128),
    MemScenario("mha", 2, 8, 512, 64, 16, 16, 128),
)
_BY_NAME = {s.name: s for s in MEMORY_SCENARIOS}


def parse_memory_scenario(text: str) -> MemScenario:
    """A name of :data:`MEMORY_SCENARIOS` or ``"G,n,P,R,Hq,Hkv,D"`` (ints) -> :class:`MemScenario`."""
    if text in _BY_NAME:
        return _BY_NAME[text]
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 7 or not all(p.isdigit() for p in parts):
        raise ValueError(f"--memory-scenario: expected one of {sorted(_BY_NAME)} or 'G,n,P,R,Hq,Hkv,D' (ints), got "
                         f"{text!r}.")
    G, n, P, R, Hq, Hkv, D = (int(p) for p in parts)
    if min(G, n, P, R, Hq, Hkv, D) < 1 or Hq % Hkv:
        raise ValueError(f"--memory-scenario: expected positive ints with Hq a multiple of Hkv, got {text!r}.")
    return MemScenario(f"{G}x{n}x{P}x{R}h{Hq}/{Hkv}d{D}", G, n, P, R, Hq, Hkv, D)


# ------------------------------------------------------------------------------------------ CPU stand-in kernels
def gpu_standin_primitives():
    """CPU stand-ins for the GPU flash kernels: the plain-torch varlen math
    (:func:`~zorro_verl.attention.primitives.torch_primitives`: ``out`` in the inputs' dtype, ``lse [Hq, Tq]``
    fp32), returning the state the GPU providers return — the kernel lse's layout
    (:func:`~zorro_verl.attention.primitives.lse_layout`, None for the flat one) and an RNG state ``[2] int64`` as
    flash-attn's — so a backend's ``ctx`` holds what it holds on GPU."""
    from zorro_verl.attention.primitives import VarlenPrimitives, lse_layout, torch_primitives

    ref = torch_primitives()

    def fwd(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window=None, softcap=None):
        out, lse, _ = ref.fwd(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window, softcap)
        return out, lse, (lse_layout(lse, q.shape[0]), torch.zeros(2, dtype=torch.int64, device=q.device))

    def bwd(dout, q, k, v, out, lse, state, *args):
        return ref.bwd(dout, q, k, v, out, lse, None, *args)

    return VarlenPrimitives("gpu_standin", fwd, bwd)


# ------------------------------------------------------------------------------------------ counting
def _ctx_tensors(root) -> list[torch.Tensor]:
    """Tensors custom autograd Functions of the graph below ``root`` keep on their ``ctx`` (outside
    ``save_for_backward``: kernel states, index sets)."""
    found, seen, todo = [], set(), [root]

    def collect(x):
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, (list, tuple)):
            for y in x:
                collect(y)
        elif isinstance(x, dict):
            for y in x.values():
                collect(y)

    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            for v in vars(node).values():
                collect(v)
        todo.extend(nxt for nxt, _ in node.next_functions)
    return found


def saved_bytes(fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, dict]:
    """Run ``fn()`` (a differentiable attention) and count what it keeps for backward: ``(out, {"float": bytes,
    "index": bytes, "storages": n})`` — every saved tensor and every tensor on a custom Function's ``ctx``, one
    count per storage (its whole size); ``float``: floating-point storages, ``index``: the rest."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    tensors = saved + (_ctx_tensors(out.grad_fn) if out.grad_fn is not None else [])
    storages: dict = {}
    for t in tensors:
        s = t.untyped_storage()
        key = (t.device, s.data_ptr(), s.nbytes())
        fl, nb = storages.get(key, (False, s.nbytes()))
        storages[key] = (fl or t.is_floating_point(), nb)
    return out, {"float": sum(nb for fl, nb in storages.values() if fl),
                 "index": sum(nb for fl, nb in storages.values() if not fl), "storages": len(storages)}


# ------------------------------------------------------------------------------------------ the micro-batches
def zorro_microbatch(sc: MemScenario, pool: Optional[int] = None) -> tuple[int, int]:
    """``(rows, groups)`` of the first micro-batch zorro's micro-batcher fills to ``sc.budget`` from ``pool`` such
    groups (default: one more than could fit), each prompt counted once."""
    from zorro_verl.packing.microbatch import dynamic_microbatches

    pool = pool or sc.budget // (sc.P + sc.n * sc.R) + 1  # a group (P + n R) always fits G n (P + R)
    groups = [g for g in range(pool) for _ in range(sc.n)]
    mbs = dynamic_microbatches(groups, [sc.P] * len(groups), [sc.R] * len(groups), sc.budget)
    rows = mbs.batches[0]
    return len(rows), len({groups[b] for b in rows})


def _leaves(Hq: int, Hkv: int, T: int, D: int, dtype, device, seed: int):
    """Random ``q [1, Hq, T, D]``, ``k/v [1, Hkv, T, D]`` leaves (drawn in fp32 on the host, then cast)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1, h, T, D, generator=gen).to(device, dtype).requires_grad_(True) for h in (Hq, Hkv, Hkv)]


def _stock_fn(sc: MemScenario, dtype, device, prims):
    """The stock flash path's attention of ``G n`` rows of ``P + R`` tokens: one varlen causal call."""
    from zorro_verl.attention.primitives import varlen_attention

    B, L = sc.G * sc.n, sc.P + sc.R
    q, k, v = _leaves(sc.Hq, sc.Hkv, B * L, sc.D, dtype, device, seed=0)
    cu = torch.arange(0, B * L + 1, L, dtype=torch.int32, device=device)
    scale = sc.D ** -0.5

    def fn():
        return varlen_attention(*(x[0].transpose(0, 1) for x in (q, k, v)), cu, cu, L, L, scale, True, prims)

    return fn, (q, k, v), B, B * L


def zorro_inputs(sc: MemScenario, dtype, device, seed: int = 1):
    """zorro's micro-batch at the scenario's budget: ``(plan, q [1, Hq, T, D], k / v [1, Hkv, T, D], rows)``."""
    from zorro_verl.packing import build_plan
    from zorro_verl.testing import create_dummy_batch

    rows, groups = zorro_microbatch(sc)
    b = create_dummy_batch(rows, groups, sc.P, sc.R, device=str(device))
    plan = build_plan(b["input_ids"], b["attention_mask"], sc.R)
    return (plan, *_leaves(sc.Hq, sc.Hkv, plan.T, sc.D, dtype, device, seed), rows)


def _zorro_fn(sc: MemScenario, backend: str, dtype, device, prims):
    """``backend``'s split attention of zorro's micro-batch (``prims``: the flash backends' kernels, None: their
    own)."""
    from zorro_verl.attention import NO_FEATURES
    from zorro_verl.attention.copyfree import attend_copyfree
    from zorro_verl.attention.registry import get_backend
    from zorro_verl.attention.varlen import attend_varlen

    plan, q, k, v, rows = zorro_inputs(sc, dtype, device)
    scale = sc.D ** -0.5
    if prims is not None and backend == "flash":
        def fn():
            return attend_varlen(plan, q, k, v, scale, prims=prims)
    elif prims is not None and backend == "flash_copyfree":
        def fn():
            return attend_copyfree(plan, q, k, v, scale, prims=prims)
    else:
        be = get_backend(backend)

        def fn():
            return be.attend(plan, q, k, v, scale, NO_FEATURES)
    return fn, (q, k, v), rows, plan.T


def run_memory(scenarios=MEMORY_SCENARIOS, *, backends=None, device="cpu", dtype=torch.bfloat16, warmup=1, reps=5,
               log=print) -> list[dict]:
    """One row per (scenario, backend), the stock baseline first.

    Row keys: ``bench = "memory"``, the scenario (``scenario, G, n, P, R, Hq, Hkv, D, budget``), ``backend``,
    ``kernels``, ``rows``, ``groups``, ``T`` (tokens in the micro-batch), ``saved_mib`` / ``index_mib`` (see the
    module doc), ``ratio = saved / stock's saved`` (same budget), ``per_row_ratio`` (bytes per row vs stock's),
    ``measured`` (False: ``note`` says why); on CUDA also ``ms`` (median forward + backward of ``out.sum()`` over
    ``reps``), ``peak_mib`` (allocator peak over the step above what was allocated before it) and ``peak_ratio``.
    """
    from zorro_verl.attention.primitives import flash_primitives
    from zorro_verl.attention.registry import BACKEND_NAMES, BACKENDS
    from zorro_verl.bench.report import device_name, git_sha, versions

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if cuda and reps < 5:
        raise ValueError(f"--reps: expected >= 5 timed runs per figure (medians of at least 5), got {reps}.")
    names = list(backends) if backends else list(BACKEND_NAMES)
    bad = [b for b in names if b not in BACKENDS]
    if bad:
        raise ValueError(f"--backends: unknown {bad}; expected names from {sorted(BACKENDS)}.")
    standin = None if cuda else gpu_standin_primitives()
    gpu_kernels = flash_primitives() if cuda and BACKENDS["flash"].available(dev) else None
    common = {"device": device_name(dev), "versions": versions(), "git_sha": git_sha(), "dtype": str(dtype)}
    if cuda and gpu_kernels is None:
        raise ValueError("--memory on CUDA: the stock baseline is the flash path and no flash kernels are here "
                         "(flash-attn or PyTorch's built-in flash attention); run it on CPU (GPU index logic).")
    rows = []
    for sc in scenarios:
        head = {"bench": "memory", "scenario": sc.name, "G": sc.G, "n": sc.n, "P": sc.P, "R": sc.R, "Hq": sc.Hq,
                "Hkv": sc.Hkv, "D": sc.D, "budget": sc.budget}
        jobs = [(STOCK, "standin" if standin else gpu_kernels.name)]
        for be in names:
            if be in ("flash", "flash_copyfree") and standin is not None:
                jobs.append((be, "standin"))
            elif not BACKENDS[be].available(dev):
                jobs.append((be, None))
            else:
                jobs.append((be, gpu_kernels.name if cuda and be in ("flash", "flash_copyfree") else f"{dev.type} "
                             "torch"))
        base = None
        for be, kernels in jobs:
            row = {**head, "backend": be, "kernels": kernels, **common}
            if kernels is None:
                row.update(measured=False, note=f"no backward on {dev.type} here")
                rows.append(row)
                log(f"{sc.name:>14} {be:>15}: not measured ({row['note']})")
                continue
            prims = standin if kernels == "standin" else None
            if be == STOCK:
                fn, leaves, nrows, T = _stock_fn(sc, dtype, dev, prims or gpu_kernels)
            else:
                fn, leaves, nrows, T = _zorro_fn(sc, be, dtype, dev, prims)
            out, count = saved_bytes(fn)
            del out
            row.update(measured=True, rows=nrows, groups=sc.G if be == STOCK else zorro_microbatch(sc)[1], T=T,
                       saved_mib=count["float"] / 2**20, index_mib=count["index"] / 2**20)
            if cuda:
                row.update(_time_and_peak(fn, leaves, dev, warmup, reps))
            if be == STOCK:
                base = row
            row["ratio"] = row["saved_mib"] / base["saved_mib"]
            row["per_row_ratio"] = row["ratio"] * base["rows"] / nrows
            if cuda:
                row["peak_ratio"] = row["peak_mib"] / base["peak_mib"]
            rows.append(row)
            log(f"{sc.name:>14} {be:>15}: rows {nrows:3d}  T {T:6d}  saved {row['saved_mib']:8.2f} MiB  "
                f"ratio {row['ratio']:5.3f}" + (f"  {row['ms']:.2f} ms  peak {row['peak_mib']:.1f} MiB" if cuda
                                                 else ""))
            del fn, leaves
    return rows


def _time_and_peak(fn, leaves, dev: torch.device, warmup: int, reps: int) -> dict:
    """CUDA: median wall ms of forward + backward of ``fn().sum()`` and the allocator peak over one step above
    what was allocated before it (MiB)."""
    times, peak = [], 0
    for i in range(warmup + reps):
        for t in leaves:
            t.grad = None
        torch.cuda.synchronize(dev)
        before = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn().float().sum().backward()
        end.record()
        torch.cuda.synchronize(dev)
        peak = max(peak, torch.cuda.max_memory_allocated(dev) - before)
        if i >= warmup:
            times.append(start.elapsed_time(end))
    for t in leaves:
        t.grad = None
    return {"ms": statistics.median(times), "runs_ms": times, "peak_mib": peak / 2**20}


# ------------------------------------------------------------------------------------------ report
def format_memory_table(rows: list[dict]) -> str:
    """The rows as the markdown table docs/BENCHMARKS.md quotes."""
    from zorro_verl.bench.report import markdown_table

    cuda = any("ms" in r for r in rows)
    head = ["scenario (G,n,P,R, Hq/Hkv x D)", "budget", "backend", "kernels", "rows", "T", "saved MiB",
            "vs stock", "per row vs stock", "index MiB"] + (["ms fwd+bwd", "peak MiB", "peak vs stock"] if cuda
                                                            else [])
    body = []
    for r in rows:
        sc = f"{r['scenario']} ({r['G']},{r['n']},{r['P']},{r['R']}, {r['Hq']}/{r['Hkv']} x {r['D']})"
        if not r["measured"]:
            body.append([sc, r["budget"], r["backend"], "-", "-", "-", "not measured: " + r["note"], "", "", ""]
                        + (["", "", ""] if cuda else []))
            continue
        body.append([sc, r["budget"], r["backend"], r["kernels"], r["rows"], r["T"], f"{r['saved_mib']:.2f}",
                     f"{r['ratio']:.3f}x", f"{r['per_row_ratio']:.3f}x", f"{r['index_mib']:.2f}"]
                    + ([f"{r['ms']:.2f}", f"{r['peak_mib']:.1f}", f"{r['peak_ratio']:.3f}x"] if cuda else []))
    return markdown_table(head, body)


def check_memory_rule(rows: list[dict], backend: str = "flash_copyfree") -> list[str]:
    """The memory rule on ``backend`` (what ``attention_backend: auto`` picks on CUDA with flash kernels): its
    saved bytes at the stock budget are at most stock's, on every scenario. One ``ok`` / ``FAIL`` line each."""
    lines = []
    for r in rows:
        if r["backend"] != backend or not r["measured"]:
            continue
        ok = r["ratio"] <= 1.0
        lines.append(f"{'ok' if ok else 'FAIL'}: {r['scenario']}: {backend} keeps {r['ratio']:.3f}x stock's "
                     f"saved bytes at the same token budget (rule: <= 1)")
    return lines
