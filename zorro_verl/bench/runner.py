"""The model-level benchmark: zorro's deduplicated step vs the ordinary forward on the same model and batches.

Per scenario ``(B, G, P, R)`` and mode (``fwd``: no grad, like old/ref log-prob; ``fwd_bwd``: log-prob sum +
backward), on rotated batches (``input_ids [B, P+R] int64`` ...), interleaved run by run:

* ``a2a``  — the ordinary padded batched forward ``[B, S]`` with the *same* response-only log-prob head;
* ``full`` — the ordinary forward with full logits ``[B, S, V]`` (what verl does by default), in row chunks;
* ``zorro:<backend>`` — plan building + deduplicated forward (+ backward) through that attention backend.

Plus the plan check: host-side plan building (``build_plan`` + the backend's index set) vs a whole zorro
``fwd_bwd`` step. Row keys: see :func:`run_bench`.
"""

from __future__ import annotations

import statistics
from typing import Optional

import torch

from zorro_verl.bench.flops import flop_model
from zorro_verl.bench.models import build_model
from zorro_verl.bench.report import device_name, git_sha, versions
from zorro_verl.bench.scenarios import Scenario
from zorro_verl.bench.timing import Clock, steady_heap, time_interleaved

__all__ = ["Runner", "make_batches", "check_backends", "common_fields", "run_bench", "plan_check"]


class Runner:
    """The three kinds of step on one model. Each step takes a prepared batch and a mode; ``fwd_bwd`` also runs
    backward of ``sum(log_probs)`` (gradients are dropped between runs, outside the timer)."""

    def __init__(self, model, grad_ckpt: bool, baseline_rows: Optional[int]):
        self.model = model
        self.grad_ckpt = grad_ckpt
        self.baseline_rows = baseline_rows

    # attention implementation switches happen outside the timer (prepare)
    def use_baseline(self):
        from zorro_verl.integrations.transformers import uninstall_zorro

        uninstall_zorro(self.model)
        if self.model.config._attn_implementation != "sdpa":
            self.model.set_attn_implementation("sdpa")

    def use_zorro(self):
        from zorro_verl.integrations.transformers import install_zorro

        install_zorro(self.model, probe=False)

    def reset(self):
        self.model.zero_grad(set_to_none=True)

    def _chunks(self, B: int):
        step = self.baseline_rows or B
        return [(s, min(B, s + step)) for s in range(0, B, step)]

    def baseline(self, batch: dict, mode: str, full_logits: bool) -> torch.Tensor:
        """Ordinary padded forward ``[B, S]``; returns the log-prob sum. The full-logits variant runs in row chunks
        of ``baseline_rows`` (gradient accumulation), as verl's micro-batches would."""
        from zorro_verl.logprob import response_logprobs
        from zorro_verl.testing import ordinary_logprobs_padded

        m = self.model
        ids, am, pos = batch["input_ids"], batch["attention_mask"], batch["position_ids"]
        R = batch["responses"].shape[1]
        Pw = ids.shape[1] - R
        total = 0.0
        # Only the full-logits baseline is chunked: its [rows, S, V] logits are what does not fit.
        for s, e in (self._chunks(ids.shape[0]) if full_logits else [(0, ids.shape[0])]):
            with torch.set_grad_enabled(mode == "fwd_bwd"):
                if full_logits:
                    lp, _ = ordinary_logprobs_padded(m, ids[s:e], am[s:e], pos[s:e], R)
                    loss = (lp * batch["response_mask"][s:e]).sum()
                else:
                    hidden = m.model(input_ids=ids[s:e], attention_mask=am[s:e], position_ids=pos[s:e],
                                     use_cache=False).last_hidden_state  # [b, S, H]
                    valid = am[s:e, Pw:].bool()  # [b, R]
                    h = hidden[:, Pw - 1:-1][valid]  # [n, H], response-predicting rows only
                    lp, _ = response_logprobs(h, m.get_output_embeddings(), ids[s:e, Pw:][valid])
                    loss = lp.sum()
            if mode == "fwd_bwd":
                loss.backward()
            total = total + loss.detach()
        return total

    def zorro(self, batch: dict, mode: str, backend: str, sharing: str = "prompt") -> torch.Tensor:
        """Plan building (``sharing``: ``prompt`` or ``prefix``) + deduplicated forward (+ backward); returns the
        log-prob sum."""
        from zorro_verl.integrations.transformers import zorro_step
        from zorro_verl.packing import build_plan

        R = batch["responses"].shape[1]
        plan = build_plan(batch["input_ids"], batch["attention_mask"], R, sharing=sharing)
        with torch.set_grad_enabled(mode == "fwd_bwd"):
            lp, _ = zorro_step(self.model, plan, backend=backend)
            loss = lp.sum()
        if mode == "fwd_bwd":
            loss.backward()
        return loss.detach()


def make_batches(sc: Scenario, k: int, device: str) -> list[dict]:
    """``k`` rotated batches of one scenario: the same lengths (so the same work), different rows order (siblings
    not adjacent) and different token ids (a bijection on real tokens, so the grouping is unchanged)."""
    from zorro_verl.testing import create_dummy_batch

    vocab = 4000
    b0 = create_dummy_batch(sc.B, sc.G, sc.P, sc.R, device=device, add_padding=sc.ragged, vocab_size=vocab,
                            seed=1000)
    out = [b0]
    for i in range(1, k):
        perm = torch.randperm(sc.B, generator=torch.Generator().manual_seed(i)).to(device)
        b = {key: val[perm] for key, val in b0.items()}
        ids = torch.where(b["attention_mask"].bool(), (b["input_ids"] - 1 + 37 * i) % (vocab - 1) + 1, 0)
        b["input_ids"] = ids
        b["responses"] = ids[:, -sc.R:] * b["response_mask"]
        out.append(b)
    return out


def setup_run(reps: int, device, backends) -> tuple[torch.device, list[str]]:
    """Checks and process settings shared by the model-level and op-level runs: ``(device, backends)``."""
    if reps < 5:
        raise ValueError(f"--reps: expected >= 5 timed runs per figure (medians of at least 5), got {reps}.")
    dev = torch.device(device)
    backends = check_backends(backends, dev)
    if dev.type == "cpu":
        steady_heap()
    return dev, backends


def check_backends(backends, device: torch.device) -> list[str]:
    """``backends`` (``None``: every backend available on ``device``) as a list, each known and available."""
    from zorro_verl.attention.registry import BACKENDS, available_backends

    if not backends:
        return list(available_backends(device))
    backends = list(backends)
    bad = [b for b in backends if b not in BACKENDS]
    if bad:
        raise ValueError(f"--backends: unknown {bad}; expected names from {sorted(BACKENDS)}.")
    missing = [b for b in backends if not BACKENDS[b].available(device)]
    if missing:
        raise ValueError(f"--backends: {missing} cannot run on {device} here; available: "
                         f"{available_backends(device)}.")
    return backends


def common_fields(dev: torch.device, dtype: torch.dtype, model_shape: str, clock: str, reps: int, warmup: int,
                  grad_ckpt: bool) -> dict:
    """Provenance and settings every row records."""
    return {"device": device_name(dev), "versions": versions(), "git_sha": git_sha(), "dtype": str(dtype),
            "model": model_shape, "clock": clock, "reps": reps, "warmup": warmup,
            "threads": torch.get_num_threads(), "grad_ckpt": grad_ckpt}


def run_bench(scenarios, *, modes=("fwd", "fwd_bwd"), backends=None, model_shape="quick", dtype=torch.float32,
              device="cpu", warmup=1, reps=5, clock="cpu", grad_ckpt=False, baseline_rows=None,
              full_logits=True, plan_scenario: Optional[Scenario] = None, lora_rank: int = 0,
              log=print) -> list[dict]:
    """Run the grid; returns one row per (scenario, mode, backend, baseline), then the plan-check row.

    ``lora_rank > 0``: LoRA training instead of full fine-tuning — a PEFT adapter of that rank on every linear layer
    but the head (``all-linear``), the base weights frozen; the ideal adds the adapters' matmuls and counts the
    frozen weights' backward as input gradients only (:func:`~zorro_verl.bench.flops.flop_model`).

    Row keys: the scenario (``scenario, B, G, P, R, n, ragged``; ``scenario`` ends in ``+lora<r>`` and
    ``lora_rank`` is set with LoRA), ``mode, backend, baseline`` (``a2a`` / ``full``),
    medians ``baseline_ms, zorro_ms`` and every run (``*_runs_ms``), ``speedup`` (ratio of medians),
    ``speedup_paired`` (median of the per-run ratios), ``ideal_speedup`` (FLOP model), ``efficiency(_paired)``,
    peak memory ``*_peak_mb`` (``mem_method``), throughputs ``*_tok_per_s``, ``logprob_sum_rel_diff`` (zorro vs
    the ordinary forward on the first batch) and the provenance of :func:`common_fields`.
    """
    from zorro_verl.packing import build_plan

    dev, backends = setup_run(reps, device, backends)
    model = build_model(model_shape, dtype, device)
    adapter_flops = 0
    if lora_rank:
        from zorro_verl.integrations.transformers.lora import apply_lora, lora_flops_per_token

        apply_lora(model, lora_rank)  # in place: `model` runs with the adapter, its base weights frozen
        adapter_flops = lora_flops_per_token(model)
    if grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # no dropout in Qwen3; train mode as in update_policy
    ck = Clock(clock, dev.type == "cuda")
    runner = Runner(model, grad_ckpt, baseline_rows)
    common = {**common_fields(dev, dtype, model_shape, clock, reps, warmup, grad_ckpt), "lora_rank": lora_rank}
    if baseline_rows is not None:
        common["baseline_rows"] = baseline_rows
    rows = []
    for sc in scenarios:
        batches = make_batches(sc, 3, device)
        b0 = batches[0]
        if baseline_rows is None and dev.type == "cuda":  # full logits [rows, S, V] + fp32 copies within ~24 GiB
            runner.baseline_rows = max(1, min(sc.B, int(24 * 2**30 // ((sc.P + sc.R) * model.config.vocab_size
                                                                         * 12))))
        # FLOPs of exactly the batches the timed runs used (ragged batches differ in their lengths): summed over
        # the timed runs, so the ideal is total ordinary work / total zorro work of the same runs.
        per_batch = []
        for bt in batches:
            pl = build_plan(bt["input_ids"], bt["attention_mask"], sc.R)
            per_batch.append(flop_model(model.config, pl.row_prompt_lens.cpu(), pl.response_lens.cpu(),
                                        pl.row_group.cpu(), bt["input_ids"].shape[1], adapter_flops))
        used = [per_batch[i % len(batches)] for i in range(warmup, warmup + reps)]
        fl = {k: sum(f[k] for f in used) / reps for k in used[0]}  # mean per timed run
        # Sanity: zorro's log-probs equal the baseline's on this batch (recorded, not asserted: dtype-dependent).
        with torch.no_grad():
            runner.use_baseline()
            ref = runner.baseline(b0, "fwd", full_logits=False)
            runner.use_zorro()
            got = runner.zorro(b0, "fwd", backends[0])
        rel_diff = float((got - ref).abs() / ref.abs().clamp_min(1e-30))
        for mode in modes:
            variants = {"a2a": (runner.use_baseline, lambda b, m=mode: runner.baseline(b, m, False))}
            if full_logits:
                variants["full"] = (runner.use_baseline, lambda b, m=mode: runner.baseline(b, m, True))
            for be in backends:
                variants["zorro:" + be] = (runner.use_zorro, lambda b, m=mode, be=be: runner.zorro(b, m, be))
            times, peak, method = time_interleaved(variants, batches, warmup, reps, ck, runner.reset, dev)
            med = {k: statistics.median(v) for k, v in times.items()}
            for be in backends:
                z = "zorro:" + be
                for base in [k for k in ("a2a", "full") if k in variants]:
                    fb = "_fwd_bwd" if mode == "fwd_bwd" else ""
                    ideal = fl[("baseline" if base == "a2a" else "baseline_full") + fb] / fl["zorro" + fb]
                    speed = med[base] / med[z]
                    # median of the per-run ratios of interleaved neighbours (robust to slow load drifts)
                    paired = statistics.median(b / z for b, z in zip(times[base], times[z]))
                    rows.append({
                        "scenario": sc.name + (f"+lora{lora_rank}" if lora_rank else ""),
                        "B": sc.B, "G": sc.G, "P": sc.P, "R": sc.R, "n": sc.n,
                        "ragged": sc.ragged, "mode": mode, "backend": be, "baseline": base,
                        "baseline_ms": med[base], "zorro_ms": med[z], "speedup": speed, "ideal_speedup": ideal,
                        "efficiency": speed / ideal, "speedup_paired": paired, "efficiency_paired": paired / ideal,
                        "baseline_peak_mb": peak[base], "zorro_peak_mb": peak[z],
                        "mem_method": method, "baseline_tok_per_s": fl["baseline_tokens"] / med[base] * 1e3,
                        "zorro_tok_per_s": fl["zorro_tokens"] / med[z] * 1e3,
                        "resp_tok_per_s": fl["N"] / med[z] * 1e3, "baseline_resp_tok_per_s": fl["N"] / med[base] * 1e3,
                        "baseline_runs_ms": times[base], "zorro_runs_ms": times[z],
                        "logprob_sum_rel_diff": rel_diff, "full_logits_rows_per_chunk": runner.baseline_rows,
                        **common,
                    })
                    log(f"{rows[-1]['scenario']:>9} {mode:>7} {be:>14} vs {base:>4}: base {med[base]:9.1f} ms  zorro "
                        f"{med[z]:9.1f} ms  speedup {speed:5.2f}  ideal {ideal:5.2f}  eff {speed / ideal:5.2f}")
    if plan_scenario is not None:
        rows.append(plan_check(plan_scenario, runner, backends[0], ck, warmup, reps, device, common, log))
    return rows


def plan_check(sc: Scenario, runner: Runner, backend: str, ck: Clock, warmup: int, reps: int, device: str,
               common: dict, log) -> dict:
    """Host-side plan building (``build_plan`` + the backend's index set) vs a whole zorro fwd_bwd step."""
    from zorro_verl.attention.registry import get_backend
    from zorro_verl.packing import build_plan

    batches = make_batches(sc, 3, device)
    runner.use_zorro()
    index = get_backend(backend).index

    def plan_only(b):
        index(build_plan(b["input_ids"], b["attention_mask"], sc.R))

    variants = {"plan": (lambda: None, plan_only),
                "step": (lambda: None, lambda b: runner.zorro(b, "fwd_bwd", backend))}
    times, _, _ = time_interleaved(variants, batches, warmup, reps, ck, runner.reset, torch.device(device))
    plan_ms, step_ms = statistics.median(times["plan"]), statistics.median(times["step"])
    log(f"{sc.name:>9} plan building {plan_ms:.2f} ms = {100 * plan_ms / step_ms:.2f}% of a zorro fwd_bwd step "
        f"({step_ms:.1f} ms), B={sc.B} G={sc.G}")
    return {"scenario": sc.name, "B": sc.B, "G": sc.G, "P": sc.P, "R": sc.R, "n": sc.n, "ragged": sc.ragged,
            "mode": "plan", "backend": backend, "baseline": None, "plan_ms": plan_ms, "zorro_ms": step_ms,
            "plan_fraction": plan_ms / step_ms, "plan_runs_ms": times["plan"], "zorro_runs_ms": times["step"],
            **common}
