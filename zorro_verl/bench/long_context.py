"""The long-context benchmark (``--long``): zorro vs the stock engine at the same sequence sharding, on long prompts,
one row per (engine, scenario), with the tokens each rank holds and the bytes each rank hands to the sharding's
collective (counted during the run and checked against the cost model), the FLOP model's ideal and the efficiency.

A scenario (:class:`LongScenario`): ``G`` prompts of ``P`` tokens x ``n`` rollouts (``B = G n`` rows), responses
of ``R_min..R_max`` tokens drawn per row, siblings not adjacent (rows shuffled); both engines run verl's dynamic
micro-batches at the same per-GPU token budget ``budget`` (x the sharding degree per group, as verl counts it).
Each engine's steps, interleaved run by run on every rank (a barrier before each timed call):

* ``infer`` — one log-prob pass over the batch (old log-probs / reference);
* ``train`` — one training step (forward, backward, optimizer step; verl's PPO loss).

Rows (:func:`long_row`): medians of both, the speed-up (ratio of medians) and the paired speed-up (median of
neighbouring runs' ratios), ``ideal_train`` / ``ideal_infer`` (the FLOP model: stock = verl's remove-padding forward,
every row whole, logits on every token; zorro = each micro-batch's packed row, each prompt once per micro-batch,
the head on response-predicting rows only: :func:`~zorro_verl.bench.flops.flop_model` per zorro micro-batch),
``efficiency_*`` = paired / ideal; per rank and training step (forward + backward) ``*_rank_tokens`` (tokens the
rank's model forward embeds, counted by a hook) and ``*_comm_bytes`` (bytes handed to the collective, counted by a
wrapper), each next to ``*_model`` (the sharding's cost model over the engine's own micro-batches: verl's for stock,
zorro's for zorro), and ``logprob_max_abs_diff`` (zorro vs stock log-probs of the first pass).

**Engines and shardings are registries** so that another engine's row reuses the columns: a
:class:`ShardingModel` (:data:`SHARDINGS`; ``sp``: Ulysses, :func:`ulysses_rank_tokens` / :func:`ulysses_step_bytes`)
says what one rank holds and sends for one micro-batch's packed row, and a :class:`LongEngine`
(:data:`LONG_ENGINES`; ``verl-fsdp``: :mod:`zorro_verl.bench.long_verl`, verl 0.9's FSDP engine under Ulysses SP)
runs the two engines and returns the measured dict of :func:`long_row`. The Megatron row is
``ShardingModel("cp", ...)`` (:func:`cp_rank_tokens`, :func:`cp_step_bytes`: its rank tokens and the K/V bytes its
all-gathers receive per micro-batch) and ``LongEngine("verl-megatron", "cp", ...)`` (:mod:`zorro_verl.bench.
long_megatron`: verl 0.9's Megatron engine, stock vs zorro at the same context-parallel size; on the CPU stock's CP
attention is the test support's stand-in of Transformer Engine's). Another engine registers its own with
:func:`register_sharding` / :func:`register_long_engine`.

The CPU run needs the repository checkout on ``PYTHONPATH`` (verl's CPU platform and the plain-torch stand-in of
flash-attention's varlen kernel that verl's stock Ulysses path calls live in the test support, never shipped).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from zorro_verl.attention.ulysses import all_to_all_bytes
from zorro_verl.bench.report import git_sha, markdown_table, versions

__all__ = ["LongScenario", "LONG_CPU_SCENARIOS", "LONG_GPU_SCENARIOS", "LONG_SHAPES", "AttentionDims",
           "ShardingModel", "SHARDINGS", "register_sharding", "sharding_model", "ulysses_rank_tokens",
           "ulysses_step_bytes", "rank_totals", "LongEngine", "LONG_ENGINES", "register_long_engine", "long_engine",
           "parse_long_scenario", "long_config", "long_rows", "long_flops", "long_row", "check_long_rows",
           "format_long_table", "run_long_bench", "LONG_LOGPROB_TOL"]

#: fp32 log-probs of zorro vs stock at the same sharding, max abs (the fp32 engine bound of docs/design/testing.md).
LONG_LOGPROB_TOL = 1e-5


@dataclass(frozen=True)
class LongScenario:
    """``G`` prompts of ``P`` tokens x ``n`` rollouts; responses ``R_min..R_max`` tokens; ``budget``: verl's
    ``max_token_len_per_gpu`` of both engines (a micro-batch of a sharding group holds ``budget x degree`` tokens;
    it must hold the longest row, ``P + R_max``)."""

    name: str
    G: int
    n: int
    P: int
    R_min: int
    R_max: int
    budget: int

    @property
    def B(self) -> int:
        return self.G * self.n

    def check(self, degree: int) -> None:
        if min(self.G, self.n, self.P, self.R_min) < 1 or self.R_min > self.R_max:
            raise ValueError(f"long scenario {self.name}: expected G, n, P >= 1 and 1 <= R_min <= R_max, got "
                             f"G={self.G}, n={self.n}, P={self.P}, R={self.R_min}..{self.R_max}.")
        if self.budget * degree < self.P + self.R_max:
            raise ValueError(f"long scenario {self.name}: budget {self.budget} x degree {degree} tokens per "
                             f"micro-batch cannot hold a row of P + R_max = {self.P + self.R_max} tokens; raise the "
                             "budget.")


#: The CPU run (2 cores, a tiny model): 2 prompts of 2,048 tokens x 8 rollouts of 64..128 tokens, budget 2,048 per
#: rank (4,096 per SP group: one stock row, or one whole deduplicated group, per micro-batch).
LONG_CPU_SCENARIOS = (LongScenario("2k-n8", 2, 8, 2048, 64, 128, 2048),)
#: The GPU sizes (the issue's 16K-32K prompts, n = 8-16) on ``qwen3-0.6b``: 16K x 16 rollouts of 1-2K tokens and
#: 32K x 8 of 1-2K; a micro-batch of an SP group holds one whole group.
LONG_GPU_SCENARIOS = (LongScenario("16k-n16", 1, 16, 16384, 1024, 2048, 24576),
                      LongScenario("32k-n8", 1, 8, 32768, 1024, 2048, 24576))

#: Model shapes of the long run besides :data:`~zorro_verl.bench.models.MODEL_SHAPES`: ``long-tiny``, a Qwen3 of
#: hidden 64 x 2 layers (4 query / 2 KV heads of 16, SP = 2 divides the KV heads), vocabulary 512, for a 2-core CPU.
LONG_SHAPES = {
    "long-tiny": dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, intermediate_size=128, tie_word_embeddings=False),
}


def parse_long_scenario(text: str) -> LongScenario:
    """A name of :data:`LONG_CPU_SCENARIOS` / :data:`LONG_GPU_SCENARIOS`, or ``G,n,P,R_min,R_max,budget``."""
    named = {s.name: s for s in LONG_CPU_SCENARIOS + LONG_GPU_SCENARIOS}
    if text in named:
        return named[text]
    try:
        vals = [int(p) for p in text.split(",")]
    except ValueError:
        vals = []
    if len(vals) != 6:
        raise ValueError(f"--long-scenario: expected one of {sorted(named)} or G,n,P,R_min,R_max,budget, got "
                         f"{text!r}.")
    G, n, P, r0, r1, budget = vals
    return LongScenario(f"G{G}n{n}-P{P}-R{r0}..{r1}", G, n, P, r0, r1, budget)


def long_config(shape: str):
    """The transformers config of a long-run shape (:data:`LONG_SHAPES`, else
    :func:`~zorro_verl.bench.models.build_config`), positions up to 40,960."""
    from transformers import Qwen3Config

    from zorro_verl.bench.models import build_config

    if shape in LONG_SHAPES:
        cfg = Qwen3Config(max_position_embeddings=40960, rope_theta=1000000.0, attention_dropout=0.0,
                          **LONG_SHAPES[shape])
        cfg._attn_implementation = "sdpa"
        return cfg
    return build_config(shape)


# ----------------------------------------------------------------------------------------------------------------------
# Sharding cost models: what one rank holds and sends for one micro-batch's packed row
# ----------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionDims:
    """The attention dimensions the cost models read: layers, query heads, KV heads, head dim."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, cfg) -> "AttentionDims":
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, head_dim)


@dataclass(frozen=True)
class ShardingModel:
    """A sequence sharding's cost model.

    ``rank_tokens(tokens, degree) -> int``: tokens of one micro-batch's packed row (``tokens``) that each rank
    holds; ``step_bytes(tokens, degree, dims, element_size, recompute) -> int``: bytes one rank hands to the
    sharding's collectives for that micro-batch in a training step (forward + backward; ``recompute``: gradient
    checkpointing runs each layer's forward again in the backward, its exchanges included). ``collective`` names
    what is counted (the row's column header)."""

    kind: str
    title: str
    collective: str
    rank_tokens: Callable[[int, int], int]
    step_bytes: Callable[[int, int, AttentionDims, int, bool], int]


def ulysses_rank_tokens(tokens: int, sp: int) -> int:
    """Ulysses: the packed row padded to a multiple of ``sp`` and cut into ``sp`` equal slices."""
    return -(-tokens // sp)


def ulysses_step_bytes(tokens: int, sp: int, dims: AttentionDims, element_size: int, recompute: bool = False) -> int:
    """Ulysses: per attention layer, in the forward and again in the backward (and once more in the recompute of
    gradient checkpointing), q, k, v in and the output back: ``(2 | 3) layers x (2 Hq + 2 Hkv') x ceil(tokens / sp)
    x D x element_size`` (``Hkv'`` after the KV repeat, :func:`~zorro_verl.attention.ulysses.all_to_all_bytes`)."""
    local = ulysses_rank_tokens(tokens, sp)
    passes = 3 if recompute else 2
    return passes * dims.layers * all_to_all_bytes(local, sp, dims.heads, dims.kv_heads, dims.head_dim, element_size)


def cp_rank_tokens(tokens: int, cp: int) -> int:
    """Context parallelism: ``tokens`` is a micro-batch's CP buffer (stock: verl's THD rows, each padded to a multiple
    of ``2 cp``; zorro: its packed row as :func:`~zorro_verl.packing.context_parallel.cp_split` cuts it, ``cp`` slices
    of ``L``), of which each rank holds ``1 / cp``."""
    return tokens // cp


def cp_step_bytes(tokens: int, cp: int, dims: AttentionDims, element_size: int, recompute: bool = False) -> int:
    """Context parallelism: the keys / values each rank receives per attention layer in the forward (and again in
    the recompute of gradient checkpointing), ``(1 | 2) layers x`` :func:`~zorro_verl.packing.context_parallel.
    cp_kv_bytes` of its ``tokens / cp`` (zorro's all-gather; Transformer Engine's exchange moves the same volume).
    The backward's ``dk`` / ``dv`` reduction moves as much again; not counted on either side."""
    from zorro_verl.packing.context_parallel import cp_kv_bytes

    passes = 2 if recompute else 1
    return passes * dims.layers * cp_kv_bytes(cp_rank_tokens(tokens, cp), cp, dims.kv_heads, dims.head_dim,
                                              element_size)


#: The registered shardings by kind (``sp``: Ulysses; ``cp``: Megatron's context parallelism).
SHARDINGS: dict[str, ShardingModel] = {
    "sp": ShardingModel("sp", "Ulysses SP", "all-to-all", ulysses_rank_tokens, ulysses_step_bytes),
    "cp": ShardingModel("cp", "context parallelism", "K/V all-gather (fwd)", cp_rank_tokens, cp_step_bytes),
}


def register_sharding(model: ShardingModel) -> None:
    """Add (or replace) a sharding's cost model under ``model.kind``."""
    SHARDINGS[model.kind] = model


def sharding_model(kind: str) -> ShardingModel:
    if kind not in SHARDINGS:
        raise ValueError(f"long-context row: no cost model registered for sharding {kind!r} (registered: "
                         f"{sorted(SHARDINGS)}); an engine's row registers one with register_sharding.")
    return SHARDINGS[kind]


def rank_totals(kind: str, mb_tokens: Sequence[int], degree: int, dims: AttentionDims, element_size: int,
                recompute: bool = False) -> tuple[int, int]:
    """``(tokens, bytes)`` one rank holds / sends in one training step whose micro-batches' packed rows hold
    ``mb_tokens`` tokens, by the cost model of ``kind`` (``recompute``: gradient checkpointing)."""
    m = sharding_model(kind)
    return (sum(m.rank_tokens(int(t), degree) for t in mb_tokens),
            sum(m.step_bytes(int(t), degree, dims, element_size, recompute) for t in mb_tokens))


# ----------------------------------------------------------------------------------------------------------------------
# Engines
# ----------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LongEngine:
    """An engine's long-context run: ``name`` (the row's ``engine``), the ``sharding`` kind it runs under and
    ``run(scenario, settings: dict) -> measured`` (the dict :func:`long_row` reads)."""

    name: str
    sharding: str
    run: Callable[[LongScenario, dict], dict]


def _run_verl_fsdp(sc: LongScenario, settings: dict) -> dict:
    from zorro_verl.bench.long_verl import run_verl_fsdp

    cfg = long_config(settings["model"])
    return run_verl_fsdp(sc, settings, cfg, long_rows(sc, cfg.vocab_size))


def _run_verl_megatron(sc: LongScenario, settings: dict) -> dict:
    from zorro_verl.bench.long_megatron import run_verl_megatron

    cfg = long_config(settings["model"])
    return run_verl_megatron(sc, settings, cfg, long_rows(sc, cfg.vocab_size))


#: The registered engines: ``verl-fsdp`` (verl 0.9's FSDP engine under Ulysses SP, :mod:`.long_verl`) and
#: ``verl-megatron`` (its Megatron engine under context parallelism, :mod:`.long_megatron`).
LONG_ENGINES: dict[str, LongEngine] = {"verl-fsdp": LongEngine("verl-fsdp", "sp", _run_verl_fsdp),
                                       "verl-megatron": LongEngine("verl-megatron", "cp", _run_verl_megatron)}


def register_long_engine(engine: LongEngine) -> None:
    """Add (or replace) an engine's long-context run under ``engine.name``; its sharding must be registered."""
    sharding_model(engine.sharding)
    LONG_ENGINES[engine.name] = engine


def long_engine(name: str) -> LongEngine:
    if name not in LONG_ENGINES:
        raise ValueError(f"--long-engine: no long-context run registered for {name!r} (registered: "
                         f"{sorted(LONG_ENGINES)}); an engine adds one with register_long_engine.")
    return LONG_ENGINES[name]


# ----------------------------------------------------------------------------------------------------------------------
# Batches, FLOPs, rows
# ----------------------------------------------------------------------------------------------------------------------


def long_rows(sc: LongScenario, vocab: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """The scenario's rows ``[(prompt ids, response ids)]``: ``G`` prompts of ``P`` tokens, each ``n`` times with its
    own response of ``R_min..R_max`` tokens, shuffled (siblings not adjacent). Ids in ``[1, vocab)``."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (sc.P,), generator=g).tolist() for _ in range(sc.G)]
    rows = []
    for k in range(sc.G):
        for _ in range(sc.n):
            r = int(torch.randint(sc.R_min, sc.R_max + 1, (1,), generator=g))
            rows.append((prompts[k], torch.randint(1, vocab, (r,), generator=g).tolist()))
    order = torch.randperm(len(rows), generator=g).tolist()
    return [rows[i] for i in order]


def long_flops(cfg, p_len: Sequence[int], r_len: Sequence[int], group: Sequence[int],
               zorro_mb_rows: Sequence[Sequence[int]]) -> dict:
    """Forward and forward + backward FLOPs of one pass over the rows: ``stock`` (every row whole, logits on every
    token: :func:`~zorro_verl.bench.e2e.stock_flops`) and ``zorro`` (each of zorro's micro-batches as one packed row,
    :func:`~zorro_verl.bench.flops.flop_model`); ``ideal_infer`` / ``ideal_train`` their ratios."""
    from zorro_verl.bench.e2e import stock_flops
    from zorro_verl.bench.flops import flop_model

    p, r, g = (torch.tensor(list(x), dtype=torch.long) for x in (p_len, r_len, group))
    stock = stock_flops(cfg, p, r)
    z = z_fb = 0
    for rows in zorro_mb_rows:
        idx = torch.tensor(list(rows), dtype=torch.long)
        _, local = torch.unique(g[idx], return_inverse=True)
        f = flop_model(cfg, p[idx], r[idx], local, int((p[idx] + r[idx]).max()))
        z, z_fb = z + f["zorro"], z_fb + f["zorro_fwd_bwd"]
    return {"stock": stock, "stock_fwd_bwd": 3 * stock, "zorro": z, "zorro_fwd_bwd": z_fb,
            "ideal_infer": stock / z, "ideal_train": 3 * stock / z_fb}


def _paired(a: Sequence[float], b: Sequence[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b))


def long_row(engine: str, sc: LongScenario, measured: dict, cfg) -> dict:
    """One row from an engine run's ``measured`` dict:

    ``sharding`` (kind), ``degree``, ``element_size`` (bytes of the exchanged activations), ``recompute``
    (gradient checkpointing), ``clock``, ``device``,
    ``p_len`` / ``r_len`` / ``group`` (the rows), ``logprob_max_abs_diff``, and per side (``stock``, ``zorro``):
    ``train_ms`` / ``infer_ms`` (every timed run), ``mb_tokens`` (tokens of each micro-batch's packed row of the
    training step), ``rank_tokens`` / ``comm_bytes`` (counted on each rank, lists); zorro also ``mb_rows`` (its
    micro-batches' row indices)."""
    kind, degree = measured["sharding"], int(measured["degree"])
    model = sharding_model(kind)
    dims = AttentionDims.of(cfg)
    fl = long_flops(cfg, measured["p_len"], measured["r_len"], measured["group"], measured["zorro"]["mb_rows"])
    row = {"engine": engine, "parallel": f"{kind.upper()}={degree}", "sharding": kind, "degree": degree,
           "collective": model.collective, "scenario": sc.name, "G": sc.G, "n": sc.n, "B": sc.B, "P": sc.P,
           "R_min": sc.R_min, "R_max": sc.R_max, "budget": sc.budget, "clock": measured["clock"],
           "device": measured["device"], "element_size": measured["element_size"],
           "recompute": measured["recompute"],
           "logprob_max_abs_diff": measured["logprob_max_abs_diff"], "ideal_train": fl["ideal_train"],
           "ideal_infer": fl["ideal_infer"], "flops": {k: fl[k] for k in ("stock", "zorro", "zorro_fwd_bwd")}}
    for side in ("stock", "zorro"):
        m = measured[side]
        tokens, sent = rank_totals(kind, m["mb_tokens"], degree, dims, measured["element_size"],
                                   measured["recompute"])
        counted = all(b is not None for b in m["comm_bytes"])  # (stock CP on a GPU: TE's exchange is not wrapped)
        comm = list(m["comm_bytes"]) if counted else [sent]
        row.update({f"{side}_train_ms": statistics.median(m["train_ms"]),
                    f"{side}_infer_ms": statistics.median(m["infer_ms"]),
                    f"{side}_train_runs_ms": list(m["train_ms"]), f"{side}_infer_runs_ms": list(m["infer_ms"]),
                    f"{side}_micro_batches": len(m["mb_tokens"]), f"{side}_tokens": int(sum(m["mb_tokens"])),
                    f"{side}_rank_tokens": max(m["rank_tokens"]), f"{side}_rank_tokens_model": tokens,
                    f"{side}_comm_bytes": max(comm), f"{side}_comm_bytes_model": sent, f"{side}_comm_counted": counted,
                    f"{side}_counts_match": set(m["rank_tokens"]) == {tokens} and set(comm) == {sent}})
    for phase in ("train", "infer"):
        row[f"speedup_{phase}"] = row[f"stock_{phase}_ms"] / row[f"zorro_{phase}_ms"]
        row[f"speedup_{phase}_paired"] = _paired(measured["stock"][f"{phase}_ms"], measured["zorro"][f"{phase}_ms"])
        row[f"efficiency_{phase}"] = row[f"speedup_{phase}_paired"] / row[f"ideal_{phase}"]
    row["comm_ratio"] = row["zorro_comm_bytes"] / row["stock_comm_bytes"] if row["stock_comm_bytes"] else math.nan
    row["token_ratio"] = row["zorro_tokens"] / row["stock_tokens"]
    return row


def check_long_rows(rows: list[dict], dtype: str = "float32") -> list[str]:
    """``PASS`` / ``FAIL`` lines: each side's counted rank tokens and collective bytes equal its cost model on every
    rank; in fp32 the log-probs of zorro and stock within :data:`LONG_LOGPROB_TOL`. Speed is reported, not judged."""
    out = []
    for r in rows:
        ok = r["stock_counts_match"] and r["zorro_counts_match"]
        out.append(f"{'PASS' if ok else 'FAIL'} {r['engine']} {r['parallel']} {r['scenario']}: counted tokens / "
                   f"{r['collective']} bytes per rank = cost model (stock {r['stock_rank_tokens']} / "
                   f"{r['stock_comm_bytes']}, zorro {r['zorro_rank_tokens']} / {r['zorro_comm_bytes']})"
                   + ("" if r.get("stock_comm_counted", True) else "; stock's bytes: the cost model (its exchange "
                      "is not counted on this device)"))
        if dtype == "float32":
            ok = r["logprob_max_abs_diff"] <= LONG_LOGPROB_TOL
            out.append(f"{'PASS' if ok else 'FAIL'} {r['engine']} {r['parallel']} {r['scenario']}: log-probs max "
                       f"|zorro - stock| {r['logprob_max_abs_diff']:.1e} <= {LONG_LOGPROB_TOL:.0e} (fp32)")
    return out


def format_long_table(rows: list[dict]) -> str:
    """A markdown table of the rows (the form docs/BENCHMARKS.md quotes)."""
    head = ["engine", "parallel", "scenario", "G x n", "P", "R", "phase", "stock ms", "zorro ms", "speedup (paired)",
            "ideal", "efficiency", "tokens / rank, stock / zorro", "collective bytes / rank, stock / zorro"]
    body = []
    for r in rows:
        for phase in ("train", "infer"):
            comm = (f"{r['stock_comm_bytes']:,} / {r['zorro_comm_bytes']:,} ({r['collective']}, "
                    f"{r['comm_ratio']:.3f})" if phase == "train" else "")
            toks = (f"{r['stock_rank_tokens']:,} / {r['zorro_rank_tokens']:,}" if phase == "train" else "")
            body.append([r["engine"], r["parallel"], r["scenario"], f"{r['G']} x {r['n']}", r["P"],
                         f"{r['R_min']}..{r['R_max']}", phase, f"{r[f'stock_{phase}_ms']:.0f}",
                         f"{r[f'zorro_{phase}_ms']:.0f}", f"x{r[f'speedup_{phase}_paired']:.2f}",
                         f"{r[f'ideal_{phase}']:.2f}", f"**{r[f'efficiency_{phase}']:.2f}**", toks, comm])
    return markdown_table(head, body)


def run_long_bench(scenarios: Sequence[LongScenario], *, engine: str = "verl-fsdp", degree: int = 2,
                   model: str = "long-tiny", dtype: str = "float32", device: str = "cpu", reps: int = 3,
                   warmup: int = 1, clock: Optional[str] = None, backend: Optional[str] = None,
                   grad_ckpt: Optional[bool] = None, timeout_s: int = 3600, log=print) -> list[dict]:
    """One row per scenario of ``engine`` (:data:`LONG_ENGINES`) at sharding ``degree``; ``grad_ckpt`` (default: on
    CUDA only) is gradient checkpointing on both sides."""
    eng = long_engine(engine)
    sharding_model(eng.sharding)
    cuda = torch.device(device).type == "cuda"
    cfg = long_config(model)
    settings = {"degree": degree, "model": model, "dtype": dtype, "device": device, "reps": reps,
                "warmup": warmup, "clock": clock or ("wall" if cuda else "cpu"),
                # Megatron CP: the varlen CP attention (flash kernels; PyTorch's CPU ones on the CPU), as stock's
                "backend": backend or ("flash_copyfree" if eng.sharding == "cp" else "flash" if cuda else "sdpa"),
                "timeout_s": timeout_s,
                "grad_ckpt": cuda if grad_ckpt is None else grad_ckpt}
    rows = []
    for sc in scenarios:
        sc.check(degree)
        log(f"[long] {engine} {eng.sharding.upper()}={degree} {sc.name}: B={sc.B} (G={sc.G} x n={sc.n}), P={sc.P}, "
            f"R={sc.R_min}..{sc.R_max}, budget {sc.budget}/rank, model {model}, {dtype}, {device}")
        row = long_row(engine, sc, eng.run(sc, settings), cfg)
        row.update(model=model, dtype=dtype, reps=reps, warmup=warmup, backend=settings["backend"],
                   grad_ckpt=settings["grad_ckpt"], git_sha=git_sha(), versions=versions())
        log(f"[long]   train x{row['speedup_train_paired']:.2f} (ideal {row['ideal_train']:.2f}), infer "
            f"x{row['speedup_infer_paired']:.2f} (ideal {row['ideal_infer']:.2f}), {row['collective']} bytes/rank "
            f"{row['stock_comm_bytes']:,} -> {row['zorro_comm_bytes']:,}")
        rows.append(row)
    return rows
