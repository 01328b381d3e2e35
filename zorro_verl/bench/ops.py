"""The op-level attention benchmark: one layer's split attention per backend vs the ordinary per-row attention.

Per scenario ``(B, G, P, R)``, on the same rotated batches as the model-level bench (and their plans), with the
model shape's heads and head dim and the run's dtype:

* zorro: ``backend.attend(plan, q [1, Hq, T, D], k [1, Hkv, T, D], v [1, Hkv, T, D], scaling) -> [1, T, Hq, D]``
  on the packed dedup row (each unique prompt once), the backend's index set built beforehand (a layer reuses
  the one its forward built);
* ordinary: the same tokens as padded rows ``q [B, Hq, S, D]``, ``k/v [B, Hkv, S, D]`` (every row holds its own
  copy of its prompt) through transformers' SDPA attention with the key-padding + causal ``[B, 1, S, S]`` bool
  mask — or no mask and ``is_causal`` when no row is padded — exactly what the stock ``sdpa`` forward runs.

Modes: ``fwd`` (no grad) and ``fwd_bwd`` (forward + backward of ``out.sum()``; q/k/v are leaves, their gradients
dropped between runs outside the timer). Before timing, each backend's output is compared with the ordinary one on
every valid token of every row (``max_abs_diff``). Times are interleaved medians as in
:func:`zorro_verl.bench.timing.time_interleaved`. ``ideal_speedup`` is the ratio of causal (query, key) pairs,
ordinary padded rows over zorro's (:func:`zorro_verl.bench.flops.attention_pairs`).
"""

from __future__ import annotations

import statistics
import types

import torch

from zorro_verl.bench.flops import attention_pairs
from zorro_verl.bench.models import build_config
from zorro_verl.bench.runner import common_fields, make_batches, setup_run
from zorro_verl.bench.timing import Clock, time_interleaved

__all__ = ["OpInputs", "make_op_inputs", "ordinary_attention", "zorro_attention", "packed_view", "run_ops"]


class OpInputs:
    """One batch's attention inputs in both layouts (all leaves with ``requires_grad``).

    ``plan``; packed ``q [1, Hq, T, D]``, ``k``/``v [1, Hkv, T, D]``; padded ``q_pad [B, Hq, S, D]``,
    ``k_pad``/``v_pad [B, Hkv, S, D]`` (zeros on pads); ``mask [B, 1, S, S] bool`` or ``None``; ``index [B, S]``
    packed position of each padded token (-1 on pads) and ``valid [B, S] bool``; ``groups = Hq / Hkv``.
    """

    def __init__(self, plan, q, k, v, q_pad, k_pad, v_pad, mask, index, valid):
        self.plan, self.q, self.k, self.v = plan, q, k, v
        self.q_pad, self.k_pad, self.v_pad = q_pad, k_pad, v_pad
        self.mask, self.index, self.valid = mask, index, valid
        self.groups = q.shape[1] // k.shape[1]

    def leaves(self):
        return (self.q, self.k, self.v, self.q_pad, self.k_pad, self.v_pad)


def make_op_inputs(batch: dict, Hq: int, Hkv: int, D: int, dtype: torch.dtype, seed: int) -> OpInputs:
    """Random packed q/k/v for ``batch``'s plan and the same values laid out as the ordinary padded rows."""
    from zorro_verl.packing import build_plan

    ids, am = batch["input_ids"], batch["attention_mask"]
    plan = build_plan(ids, am, batch["responses"].shape[1])
    dev = ids.device
    gen = torch.Generator().manual_seed(seed)
    # drawn in fp32/fp64 on the host (same values on every device), then cast
    draw = torch.float64 if dtype == torch.float64 else torch.float32
    q, k, v = (torch.randn(1, h, plan.T, D, generator=gen, dtype=draw).to(dev, dtype) for h in (Hq, Hkv, Hkv))
    index = plan.full_index()  # [B, S]
    valid = index >= 0
    safe = index.clamp(min=0)

    def padded(x):  # [1, H, T, D] -> [B, H, S, D], zeros on pads
        return (x[0][:, safe] * valid[None, :, :, None]).permute(1, 0, 2, 3).contiguous()

    q_pad, k_pad, v_pad = padded(q), padded(k), padded(v)
    if bool(valid.all()):
        mask = None  # transformers' sdpa_mask skips a mask with no padding and lets SDPA run is_causal
    else:
        S = ids.shape[1]
        causal = torch.ones(S, S, dtype=torch.bool, device=dev).tril()
        mask = (causal[None, None] & valid[:, None, None, :]).contiguous()  # [B, 1, S, S]
    leaves = [t.requires_grad_(True) for t in (q, k, v, q_pad, k_pad, v_pad)]
    return OpInputs(plan, *leaves, mask, index, valid)


def ordinary_attention(x: OpInputs, scaling: float) -> torch.Tensor:
    """The stock forward's attention of the padded rows: transformers' ``sdpa_attention_forward`` (repeat_kv or
    SDPA's GQA, the bool mask or ``is_causal``) -> ``[B, S, Hq, D]``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    # what it reads from the attention module: the GQA group count and that the layer is causal
    module = types.SimpleNamespace(num_key_value_groups=x.groups, is_causal=True, training=False)
    out, _ = sdpa_attention_forward(module, x.q_pad, x.k_pad, x.v_pad, x.mask, dropout=0.0, scaling=scaling)
    return out


def zorro_attention(x: OpInputs, backend: str, scaling: float) -> torch.Tensor:
    """The backend's split attention of the packed row -> ``[1, T, Hq, D]``."""
    from zorro_verl.attention.registry import get_backend

    return get_backend(backend).attend(x.plan, x.q, x.k, x.v, scaling)


def packed_view(x: OpInputs, ordinary: torch.Tensor, packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ordinary [n, Hq, D], zorro [n, Hq, D])`` at every valid token of every row (a prompt token once per row
    of its group), for comparison."""
    return ordinary[x.valid], packed[0][x.index[x.valid]]


def run_ops(scenarios, *, modes=("fwd", "fwd_bwd"), backends=None, model_shape="quick", dtype=torch.float32,
            device="cpu", warmup=1, reps=5, clock="cpu", log=print) -> list[dict]:
    """Run the op-level grid; returns one row per (scenario, mode, backend).

    Row keys: ``bench = "ops"``, the scenario (``scenario, B, G, P, R, n, ragged``, and ``T, S, Hq, Hkv, D``),
    ``mode, backend, baseline = "ordinary"``, medians ``ms`` (zorro) and ``ordinary_ms`` with every run
    (``runs_ms``, ``ordinary_runs_ms``), ``ratio = ms / ordinary_ms``, ``ratio_paired`` (median of the per-run
    ratios), ``speedup = 1 / ratio``, ``ideal_speedup`` (attention pairs), ``efficiency = speedup / ideal``, peak
    memory ``peak_mb`` / ``ordinary_peak_mb`` (``mem_method``), ``max_abs_diff`` (zorro vs ordinary output on valid
    tokens, before timing) and the provenance of :func:`zorro_verl.bench.runner.common_fields`.
    """
    dev, backends = setup_run(reps, device, backends)
    cfg = build_config(model_shape)
    Hq, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // Hq
    scaling = D ** -0.5
    ck = Clock(clock, dev.type == "cuda")
    common = common_fields(dev, dtype, model_shape, clock, reps, warmup, grad_ckpt=False)
    del common["grad_ckpt"]  # no model here
    rows = []
    for sc in scenarios:
        inputs = [make_op_inputs(b, Hq, Hkv, D, dtype, seed=i) for i, b in enumerate(make_batches(sc, 3, device))]
        S = inputs[0].q_pad.shape[2]
        # ideal over exactly the batches the timed runs use (ragged batches differ in their lengths)
        pairs = [attention_pairs(x.plan.row_prompt_lens.cpu(), x.plan.response_lens.cpu(), x.plan.row_group.cpu(),
                                 S) for x in inputs]
        used = [pairs[i % len(inputs)] for i in range(warmup, warmup + reps)]
        ideal = sum(p[0] for p in used) / sum(p[1] for p in used)
        diff = {}
        with torch.no_grad():
            for be in backends:
                diff[be] = 0.0
                for x in inputs:
                    # also builds the backend's index set on each plan, outside the timer
                    a, b = packed_view(x, ordinary_attention(x, scaling), zorro_attention(x, be, scaling))
                    diff[be] = max(diff[be], float((a - b).abs().max()) if a.numel() else 0.0)

        def reset(inputs=inputs):
            for x in inputs:
                for t in x.leaves():
                    t.grad = None

        for mode in modes:
            def step(fn, mode=mode):
                if mode == "fwd_bwd":
                    fn().sum().backward()
                else:
                    with torch.no_grad():
                        fn()

            variants = {"ordinary": (lambda: None, lambda x: step(lambda: ordinary_attention(x, scaling)))}
            for be in backends:
                variants["zorro:" + be] = (lambda: None,
                                           lambda x, be=be: step(lambda: zorro_attention(x, be, scaling)))
            times, peak, method = time_interleaved(variants, inputs, warmup, reps, ck, reset, dev)
            o_ms = statistics.median(times["ordinary"])
            for be in backends:
                z = "zorro:" + be
                ms = statistics.median(times[z])
                rows.append({
                    "bench": "ops", "scenario": sc.name, "B": sc.B, "G": sc.G, "P": sc.P, "R": sc.R, "n": sc.n,
                    "ragged": sc.ragged, "T": inputs[0].plan.T, "S": S, "Hq": Hq, "Hkv": Hkv, "D": D,
                    "mode": mode, "backend": be, "baseline": "ordinary", "ms": ms, "ordinary_ms": o_ms,
                    "ratio": ms / o_ms,
                    "ratio_paired": statistics.median(a / b for a, b in zip(times[z], times["ordinary"])),
                    "speedup": o_ms / ms, "ideal_speedup": ideal, "efficiency": o_ms / ms / ideal,
                    "peak_mb": peak[z], "ordinary_peak_mb": peak["ordinary"], "mem_method": method,
                    "runs_ms": times[z], "ordinary_runs_ms": times["ordinary"], "max_abs_diff": diff[be],
                    **common,
                })
                log(f"{sc.name:>9} {mode:>7} {be:>14} attention op: ordinary {o_ms:8.2f} ms  zorro {ms:8.2f} ms  "
                    f"ratio {ms / o_ms:5.3f}  ideal speedup {ideal:5.2f}  max|diff| {diff[be]:.1e}")
    return rows
