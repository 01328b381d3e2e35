"""The Megatron benchmark (``--megatron``): zorro on megatron-core's ``GPTModel`` vs megatron's ordinary forward,
measured against the FLOP model's ideal (docs/design/math.md, megatron.md).

A scenario: ``G`` prompts x ``n`` rollouts (``B = G n`` rows); each prompt ``P_min..P`` tokens (drawn per prompt),
each response ``R_min..R_max`` tokens (drawn per row), siblings not adjacent (rows shuffled). The model: a
``GPTModel`` on megatron's local (non-Transformer-Engine) layer spec (RMSNorm, SwiGLU, RoPE, untied head, no
dropout) of a :data:`MEGATRON_SHAPES` shape, TP = PP = 1. Two copies with the same weights: the stock one, and one
whose core attention is zorro's (:func:`~zorro_verl.integrations.megatron.zorro_layer_spec`).

Per scenario, dtype and mode (``fwd``, ``fwd_bwd``), interleaved run by run:

* ``ordinary`` — megatron's ordinary forward as the project's Megatron tests define it (no project code): the rows'
  valid tokens right-padded to one ``[B, L]`` batch (``L`` the longest row), megatron's own ``DotProductAttention``
  with a causal ``[1, 1, L, L]`` mask (right padding cannot reach an earlier token), the LM head on every row
  (``[B, L, V]`` logits, as ``GPTModel`` computes them), log-softmax (fp32) gathered at the response tokens. The
  ``[B, L]`` layout is made with the batch, outside the timer (a data-pipeline step);
* ``zorro`` — plan building (:func:`~zorro_verl.packing.build_plan` on the verl-style ``[B, P + R]`` batch: left-padded
  prompts, right-padded responses) + :func:`~zorro_verl.integrations.megatron.zorro_gpt_step`;
* ``plan`` — plan building alone, for ``plan_ms``.

``fwd_bwd``: backward of the summed log-probs. Rows: medians, the paired speed-up (median of neighbouring runs'
ratios), ``ideal_speedup`` (the FLOP model with megatron's dimensions: ordinary = ``B L`` tokens, causal pairs of
``[B, L]``, the head on all ``B L`` rows; zorro = each unique prompt once + the responses, the head on the ``N``
response-predicting rows), ``efficiency_paired`` = paired / ideal, peak memory of the warm-up runs and
``logprob_max_abs_diff`` (zorro vs ordinary per-token log-probs on the first batch, a check run outside the timer).

megatron-core asks ``torch.cuda`` for devices and RNG states even for a CPU model: on a CPU-only torch the run needs
the CPU shims of the repository's test support, which are never shipped in the package (:func:`megatron_setup`).
Imports megatron-core only when a run starts.
"""

from __future__ import annotations

import importlib
import logging
import os
import statistics
import tempfile
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, Optional

import torch

from zorro_verl.bench.flops import flop_model
from zorro_verl.bench.report import logprob_check, markdown_table
from zorro_verl.bench.runner import common_fields, setup_run
from zorro_verl.bench.timing import Clock, time_interleaved

__all__ = ["MegatronScenario", "MEGATRON_SHAPES", "MEGATRON_SCENARIOS", "MEGATRON_TARGETS", "MEGATRON_DTYPES",
           "CPU_SETUP_HINT", "parse_megatron_scenario", "megatron_setup", "flop_config", "build_megatron_gpt",
           "megatron_batches", "MegatronRunner", "run_megatron_bench", "check_megatron_targets",
           "format_megatron_table"]

#: GPTModel shapes. ``quick``: the dimensions of the model-level benchmark's ``quick`` Qwen3 shape and of the
#: ``--vlm`` text model (hidden 256, 4 layers, GQA 4 heads of 64 in 2 query groups, SwiGLU 768, vocabulary 4096);
#: ``tiny``: for tests.
MEGATRON_SHAPES = {
    "quick": dict(num_layers=4, hidden_size=256, num_attention_heads=4, num_query_groups=2, kv_channels=64,
                  ffn_hidden_size=768, vocab_size=4096),
    "tiny": dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
                 ffn_hidden_size=96, vocab_size=96),
}

#: The default run's dtypes: fp32 (where log-probs are judged) and bf16 (what users train in; reported).
MEGATRON_DTYPES = (torch.float32, torch.bfloat16)

#: ``efficiency``: fp32 fwd_bwd ``efficiency_paired`` where ``ideal >= min_ideal``; ``logprob_abs``: fp32 per-token
#: log-probs of zorro vs the ordinary forward, max absolute difference. bf16 rows and rows where nothing is shared
#: are reported, not judged.
MEGATRON_TARGETS = {"efficiency": 0.85, "min_ideal": 2.0, "logprob_abs": 1e-5}

CPU_SETUP_HINT = ("run from a repository checkout: PYTHONPATH=<repo> .venv-megatron/bin/python -m zorro_verl.bench "
                  "--megatron")


@dataclass(frozen=True)
class MegatronScenario:
    """``B`` rows in ``G`` groups (``n = B / G`` rollouts each); prompts of ``P_min..P`` tokens (``P_min`` None:
    ``7 P / 8``), responses of ``R_min..R_max`` tokens, each drawn uniformly."""

    name: str
    B: int
    G: int
    P: int
    R_min: int
    R_max: int
    P_min: Optional[int] = None

    @property
    def n(self) -> int:
        return self.B // self.G

    @property
    def p_min(self) -> int:
        return self.P_min if self.P_min is not None else max(1, 7 * self.P // 8)

    def check(self) -> None:
        if self.G < 1 or self.B % self.G:
            raise ValueError(f"scenario {self.name}: B={self.B} is not a multiple of G={self.G}.")
        if not 1 <= self.p_min <= self.P or not 1 <= self.R_min <= self.R_max:
            raise ValueError(f"scenario {self.name}: expected 1 <= P_min <= P and 1 <= R_min <= R_max, got "
                             f"P {self.p_min}..{self.P}, R {self.R_min}..{self.R_max}.")


#: GRPO-like: 2 prompts x 8 rollouts, prompts 224..256 tokens, responses 32..64; and no sharing at all (4 prompts,
#: one rollout each: what zorro's plan and packed layout cost when nothing is shared; reported, not a target).
MEGATRON_SCENARIOS = (
    MegatronScenario("grpo", 16, 2, 256, 32, 64),
    MegatronScenario("noshare", 4, 4, 256, 32, 64),
)


def parse_megatron_scenario(text: str) -> MegatronScenario:
    """A name of :data:`MEGATRON_SCENARIOS`, or ``B,G,P,R_min,R_max`` (prompts ``7P/8..P``)."""
    named = {s.name: s for s in MEGATRON_SCENARIOS}
    if text in named:
        return named[text]
    try:
        vals = [int(p) for p in text.split(",")]
    except ValueError:
        vals = []
    if len(vals) != 5:
        raise ValueError(f"--megatron-scenario: expected one of {sorted(named)} or B,G,P,R_min,R_max, got {text!r}.")
    B, G, P, r0, r1 = vals
    sc = MegatronScenario(f"B{B}G{G}-P{P}-R{r0}..{r1}", B, G, P, r0, r1)
    sc.check()
    return sc


def _init_single_process(device: str) -> None:
    """One process, TP = PP = 1: a world-of-1 process group (``file://`` rendezvous in a temporary directory),
    megatron's model-parallel groups and, on CUDA, its RNG tracker."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    if not dist.is_initialized():
        init = os.path.join(tempfile.mkdtemp(prefix="zorro-bench-"), "init")
        dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{init}", rank=0,
                                world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    if device == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(0)


def megatron_setup(device: str = "cpu") -> Callable[[], None]:
    """The call that prepares this process for a one-process megatron run on ``device``.

    CUDA: the package's own (:func:`_init_single_process`). CPU: megatron-core reads ``torch.cuda`` (current device,
    RNG states) even for a CPU model; the shims that answer for it live in the repository's test support
    (``tests.support.megatron_cpu.init_megatron``) and are never shipped, so a CPU run imports them from the
    checkout on ``PYTHONPATH`` — ``RuntimeError`` naming the fix when they are not there."""
    if torch.device(device).type == "cuda":
        return lambda: _init_single_process("cuda")
    try:
        support = importlib.import_module("tests.support.megatron_cpu")
    except ImportError as e:
        raise RuntimeError(f"--megatron on the CPU: megatron-core needs the CPU shims of the repository's test "
                           f"support (tests/support/megatron_cpu.py, not part of the package), which could not be "
                           f"imported ({e}); {CPU_SETUP_HINT}") from None

    def setup() -> None:
        support.init_megatron(0, 1, os.path.join(tempfile.mkdtemp(prefix="zorro-bench-"), "init"))

    return setup


def flop_config(shape: str) -> SimpleNamespace:
    """The dimensions of a :data:`MEGATRON_SHAPES` shape under the names :func:`~zorro_verl.bench.flops.flop_model`
    reads (a dense SwiGLU GPT, every layer full attention)."""
    s = MEGATRON_SHAPES[shape]
    return SimpleNamespace(model_type="megatron_gpt", hidden_size=s["hidden_size"], num_hidden_layers=s["num_layers"],
                           num_attention_heads=s["num_attention_heads"], num_key_value_heads=s["num_query_groups"],
                           head_dim=s["kv_channels"], intermediate_size=s["ffn_hidden_size"],
                           vocab_size=s["vocab_size"])


def build_megatron_gpt(shape: str, dtype: torch.dtype, device: str, *, zorro: bool, seed: int = 0,
                       max_len: int = 4096):
    """A randomly initialised ``GPTModel`` of ``MEGATRON_SHAPES[shape]`` on megatron's local layer spec (``zorro``:
    its core attention wrapped by ``zorro_layer_spec``), parameters in ``dtype`` on ``device``. Call the
    :func:`megatron_setup` hook first."""
    import torch.nn.functional as F
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    if shape not in MEGATRON_SHAPES:
        raise ValueError(f"--model: a --megatron run expects one of {sorted(MEGATRON_SHAPES)}, got {shape!r}.")
    s = dict(MEGATRON_SHAPES[shape])
    vocab = s.pop("vocab_size")
    cfg = TransformerConfig(
        **s, use_cpu_initialization=torch.device(device).type == "cpu", gradient_accumulation_fusion=False,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0,
        # the unfused reference paths: the fused kernels are CUDA-only (Apex / TE), and the local spec runs without
        masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        persist_layer_norm=False)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    if zorro:
        from zorro_verl.integrations.megatron import zorro_layer_spec

        spec = zorro_layer_spec(spec)
    torch.manual_seed(seed)
    # GPTModel logs a deprecation notice (in favour of HybridModel) at every construction: noise in the bench's output
    log = logging.getLogger(GPTModel.__module__)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=vocab, max_sequence_length=max_len,
                         position_embedding_type="rope", share_embeddings_and_output_weights=False,
                         parallel_output=True)
    finally:
        log.setLevel(level)
    return model.to(device=device, dtype=dtype)  # torch norms are created in the default dtype


def megatron_batches(sc: MegatronScenario, k: int, vocab: int, device: str) -> list[dict]:
    """``k`` batches of one scenario (other tokens, lengths and row orders). Each:

    * verl's layout (zorro's input): ``input_ids``, ``attention_mask`` ``[B, Pw + Rw]`` int64, prompts left-padded
      to ``Pw``, responses right-padded to ``Rw`` (the longest of the batch), ``R = Rw``;
    * the ordinary forward's layout: ``stock_ids [B, L]`` (each row's valid tokens, right-padded with 0),
      ``stock_pos [B, L]``, ``stock_mask [1, 1, L, L]`` bool (True = masked: causal), and the response positions
      ``row [N]``, ``col [N]`` (row ``b``'s position ``p - 1 + j`` predicts its token ``p + j``), ``target [N]``,
      row-major (zorro's output order);
    * ``p_len``, ``r_len``, ``group`` ``[B]`` int64 (for the FLOP model)."""
    sc.check()
    out = []
    for i in range(k):
        g = torch.Generator().manual_seed(1000 + i)
        prompts = [torch.randint(1, vocab, (int(torch.randint(sc.p_min, sc.P + 1, (1,), generator=g)),),
                                 generator=g) for _ in range(sc.G)]
        group = torch.arange(sc.B) // sc.n
        group = group[torch.randperm(sc.B, generator=g)]  # siblings not adjacent
        r_len = torch.randint(sc.R_min, sc.R_max + 1, (sc.B,), generator=g)
        p_len = torch.tensor([len(prompts[j]) for j in group.tolist()])
        Pw, Rw, L = int(p_len.max()), int(r_len.max()), int((p_len + r_len).max())
        ids = torch.zeros(sc.B, Pw + Rw, dtype=torch.long)
        am = torch.zeros_like(ids)
        stock = torch.zeros(sc.B, L, dtype=torch.long)
        rows, cols, targets = [], [], []
        for b in range(sc.B):
            p, r = int(p_len[b]), int(r_len[b])
            prompt, resp = prompts[int(group[b])], torch.randint(1, vocab, (r,), generator=g)
            ids[b, Pw - p:Pw], ids[b, Pw:Pw + r] = prompt, resp
            am[b, Pw - p:Pw + r] = 1
            stock[b, :p + r] = torch.cat([prompt, resp])
            rows.append(torch.full((r,), b))
            cols.append(torch.arange(p - 1, p + r - 1))
            targets.append(resp)
        batch = {"input_ids": ids, "attention_mask": am, "R": Rw, "stock_ids": stock,
                 "stock_pos": torch.arange(L)[None].expand(sc.B, L).contiguous(),
                 "stock_mask": torch.triu(torch.ones(L, L, dtype=torch.bool), 1).view(1, 1, L, L),
                 "row": torch.cat(rows), "col": torch.cat(cols), "target": torch.cat(targets)}
        batch = {key: (val.to(device) if torch.is_tensor(val) else val) for key, val in batch.items()}
        batch.update(p_len=p_len, r_len=r_len, group=group)  # CPU: FLOP model only
        out.append(batch)
    return out


class MegatronRunner:
    """The two steps on two ``GPTModel`` copies with the same weights: ``stock`` (megatron's local spec) and
    ``zorro`` (its core attention wrapped)."""

    def __init__(self, stock, zorro, backend: str = "sdpa"):
        self.stock_model, self.zorro_model, self.backend = stock, zorro, backend

    def reset(self) -> None:
        self.stock_model.zero_grad(set_to_none=True)
        self.zorro_model.zero_grad(set_to_none=True)

    def ordinary(self, batch: dict, mode: str, per_token: bool = False) -> torch.Tensor:
        """Megatron's ordinary forward on ``[B, L]`` (logits on every row), log-softmax in fp32 at the response
        tokens; the log-prob sum (``per_token``: ``[N]`` fp32, row-major)."""
        with torch.set_grad_enabled(mode == "fwd_bwd"):
            logits = self.stock_model(input_ids=batch["stock_ids"], position_ids=batch["stock_pos"],
                                      attention_mask=batch["stock_mask"])  # [B, L, V]
            logp = torch.log_softmax(logits[batch["row"], batch["col"]].float(), -1)  # [N, V]
            lp = logp.gather(-1, batch["target"][:, None])[:, 0]
            loss = lp.sum()
        if mode == "fwd_bwd":
            loss.backward()
        return lp.detach() if per_token else loss.detach()

    def plan(self, batch: dict):
        from zorro_verl.packing import build_plan

        return build_plan(batch["input_ids"], batch["attention_mask"], batch["R"])

    def zorro(self, batch: dict, mode: str, per_token: bool = False) -> torch.Tensor:
        """Plan building + ``zorro_gpt_step``; the log-prob sum (``per_token``: ``[N]``, row-major)."""
        from zorro_verl.integrations.megatron import zorro_gpt_step

        plan = self.plan(batch)
        with torch.set_grad_enabled(mode == "fwd_bwd"):
            lp, _ = zorro_gpt_step(self.zorro_model, plan, backend=self.backend)
            loss = lp.sum()
        if mode == "fwd_bwd":
            loss.backward()
        return lp.detach() if per_token else loss.detach()


def _versions_megatron() -> dict:
    try:
        from importlib.metadata import version

        return {"megatron_core": version("megatron-core")}
    except Exception:  # provenance only: never fail a run over it
        return {"megatron_core": None}


def run_megatron_bench(scenarios=MEGATRON_SCENARIOS, *, setup: Callable[[], None], modes=("fwd", "fwd_bwd"),
                       dtypes=MEGATRON_DTYPES, model_shape: str = "quick", device: str = "cpu", warmup: int = 1,
                       reps: int = 5, clock: str = "cpu", backend: str = "sdpa", log=print) -> list[dict]:
    """Run the grid; one row per (dtype, scenario, mode) (fields: the module docstring). ``setup``: the process
    preparation :func:`megatron_setup` returns (or the tests' own)."""
    dev, _ = setup_run(reps, device, [backend])
    setup()
    cfg = flop_config(model_shape)
    ck = Clock(clock, dev.type == "cuda")
    rows = []
    for dtype in dtypes:
        stock = build_megatron_gpt(model_shape, dtype, device, zorro=False)
        zmodel = build_megatron_gpt(model_shape, dtype, device, zorro=True)
        zmodel.load_state_dict(stock.state_dict())
        stock.train()  # no dropout; train mode as in a training step
        zmodel.train()
        runner = MegatronRunner(stock, zmodel, backend)
        common = common_fields(dev, dtype, model_shape, clock, reps, warmup, False)
        common["versions"].update(_versions_megatron())
        for sc in scenarios:
            batches = megatron_batches(sc, 3, cfg.vocab_size, device)
            fl: dict = {}
            for i in range(warmup, warmup + reps):  # FLOPs of exactly the batches the timed runs use
                bt = batches[i % len(batches)]
                f = flop_model(cfg, bt["p_len"], bt["r_len"], bt["group"], bt["stock_ids"].shape[1])
                for key, val in f.items():
                    fl[key] = fl.get(key, 0) + val / reps
            with torch.no_grad():  # check run (not timed): per-token log-probs of both sides on the first batch
                ref = runner.ordinary(batches[0], "fwd", per_token=True)
                got = runner.zorro(batches[0], "fwd", per_token=True)
            lp_diff = float((got.double() - ref.double()).abs().max())
            for mode in modes:
                variants = {"ordinary": (lambda: None, lambda b, m=mode, r=runner: r.ordinary(b, m)),
                            "zorro": (lambda: None, lambda b, m=mode, r=runner: r.zorro(b, m)),
                            "plan": (lambda: None, runner.plan)}
                times, peak, method = time_interleaved(variants, batches, warmup, reps, ck, runner.reset, dev)
                med = {k: statistics.median(v) for k, v in times.items()}
                paired = statistics.median(a / z for a, z in zip(times["ordinary"], times["zorro"]))
                fb = "_fwd_bwd" if mode == "fwd_bwd" else ""
                # megatron's GPTModel computes the head on every row: the ordinary side is flop_model's full-logits
                ideal = fl["baseline_full" + fb] / fl["zorro" + fb]
                row = {"bench": "megatron", "scenario": sc.name, "B": sc.B, "G": sc.G, "n": sc.n, "P_min": sc.p_min,
                       "P": sc.P, "R_min": sc.R_min, "R_max": sc.R_max, "mode": mode, "backend": backend,
                       "ordinary_ms": med["ordinary"], "zorro_ms": med["zorro"], "plan_ms": med["plan"],
                       "plan_fraction": med["plan"] / med["zorro"], "speedup": med["ordinary"] / med["zorro"],
                       "speedup_paired": paired, "ideal_speedup": ideal, "efficiency_paired": paired / ideal,
                       # the ideal were the ordinary side's head on the response-predicting rows only
                       "ideal_response_head": fl["baseline" + fb] / fl["zorro" + fb],
                       "ordinary_tokens": round(fl["baseline_tokens"]), "zorro_tokens": round(fl["zorro_tokens"]),
                       "response_tokens": round(fl["N"]),
                       "flops_ordinary": fl["baseline_full" + fb], "flops_zorro": fl["zorro" + fb],
                       "ordinary_peak_mb": peak["ordinary"], "zorro_peak_mb": peak["zorro"], "mem_method": method,
                       "ordinary_runs_ms": times["ordinary"], "zorro_runs_ms": times["zorro"],
                       "plan_runs_ms": times["plan"], "logprob_max_abs_diff": lp_diff, **common}
                rows.append(row)
                log(f"{str(dtype)[6:]:>8} {sc.name:>8} {mode:>7}: ordinary {med['ordinary']:8.1f} ms  zorro "
                    f"{med['zorro']:8.1f} ms  x{paired:.2f}  ideal {ideal:.2f}  eff {paired / ideal:.2f}  "
                    f"plan {med['plan']:.1f} ms  peak {peak['ordinary']:.0f}/{peak['zorro']:.0f} MiB  "
                    f"|dlp| {lp_diff:.1e}")
    return rows


def check_megatron_targets(rows: list[dict], targets: Optional[dict] = None) -> list[str]:
    """``PASS`` / ``FAIL`` lines (:data:`MEGATRON_TARGETS`), fp32 rows only: fwd_bwd efficiency where the ideal is
    >= ``min_ideal``, log-prob equality once per scenario; ``INFO`` lines for what is reported, not judged (bf16
    efficiency and log-prob difference, the time ratio where nothing is shared)."""
    t = targets or MEGATRON_TARGETS
    out, seen = [], set()
    for r in rows:
        fp32 = r["dtype"] == str(torch.float32)
        dt = r["dtype"].replace("torch.", "")
        if r["mode"] == "fwd_bwd" and r["ideal_speedup"] >= t["min_ideal"]:
            ok = r["efficiency_paired"] >= t["efficiency"]
            tag = ("PASS" if ok else "FAIL") if fp32 else "INFO"
            out.append(f"{tag} {r['scenario']}: efficiency {r['efficiency_paired']:.2f} "
                       f"{'>=' if ok else '<'} {t['efficiency']} (fwd_bwd, {dt}, ideal {r['ideal_speedup']:.2f})")
        if r["mode"] == "fwd_bwd" and r["G"] == r["B"]:
            out.append(f"INFO {r['scenario']}: zorro / ordinary time {1 / r['speedup_paired']:.3f} (fwd_bwd, {dt}, "
                       f"nothing shared; plan building {r['plan_ms']:.1f} ms = {100 * r['plan_fraction']:.1f} % of "
                       f"zorro's step)")
        if (r["scenario"], r["dtype"]) not in seen:
            seen.add((r["scenario"], r["dtype"]))
            if fp32:
                out.append(logprob_check(r, t["logprob_abs"])[1])
            else:
                out.append(f"INFO {r['scenario']}: log-probs max |zorro - ordinary| {r['logprob_max_abs_diff']:.1e} "
                           f"({dt}: different kernels round differently)")
    return out


def format_megatron_table(rows: list[dict]) -> str:
    """A markdown table of the rows (the form docs/BENCHMARKS.md quotes)."""
    head = ["dtype", "scenario", "B", "n", "P", "R", "mode", "ordinary ms", "zorro ms", "of which plan ms",
            "speedup", "ideal", "efficiency", "peak MiB ordinary / zorro"]
    return markdown_table(head, [
        [r["dtype"].replace("torch.", ""), r["scenario"], r["B"], r["n"], f"{r['P_min']}..{r['P']}",
         f"{r['R_min']}..{r['R_max']}", r["mode"], f"{r['ordinary_ms']:.0f}", f"{r['zorro_ms']:.0f}",
         f"{r['plan_ms']:.1f}", f"x{r['speedup_paired']:.2f}", f"{r['ideal_speedup']:.2f}",
         f"**{r['efficiency_paired']:.2f}**", f"{r['ordinary_peak_mb']:.0f} / {r['zorro_peak_mb']:.0f}"]
        for r in rows])
