"""Logits memory of the zorro engine vs verl 0.9's stock FSDP engine on CPU (docs/BENCHMARKS.md, "Logits memory vs
the stock verl engine").

    python scripts/verl_memory.py                 # engine table, bf16 (every mode, infer + train, two batchings)
    python scripts/verl_memory.py --dtype fp32    # the same in fp32 (where the softmax's upcast is free)
    python scripts/verl_memory.py --bytes         # head-level bytes per logits element + the Qwen3-8B projection
    python scripts/verl_memory.py --quick         # one small engine configuration
    python scripts/verl_memory.py --json out.json

Engine table: each configuration runs in a fresh subprocess: verl's real engine (FSDP2 over 1-rank gloo, the test
CPU platform from tests/support; ``bf16``: verl's default mixed precision, fp32 parameters and bf16 compute, so the
logits are bf16), a tiny untied Qwen3 with a 32K vocabulary (so the LM head dominates), one warm-up call, then the
measured call (``infer_batch`` with entropy, or ``train_batch`` with entropy and verl's PPO loss). The stock engine
runs its own default path (``use_torch_compile=True``: the entropy compiled by inductor; on CPU the log-probs come
from verl's ``logprobs_from_logits_v2``, flash-attn being absent) and, as a second row, ``use_torch_compile=False``.
Memory: the peak RSS delta of that call — VmHWM (/proc/self/status) after resetting it through /proc/self/clear_refs,
minus the RSS before the call — with glibc's mmap threshold fixed at 64 KiB and trimming at 128 KiB, so that freed
tensors go back to the OS and RSS follows live memory.

Head-level bytes (``--bytes``): one head pass on ``[N, V]`` bf16 logits (inference: log-probs + entropy; training:
the same plus the gradient w.r.t. the logits), its peak allocation counted by
:class:`zorro_verl.bench.timing.LiveTensorBytes` (torch's storage sizes: deterministic), divided by ``N x V``: the
bytes each path holds per logits element beyond the logits themselves. Paths: verl's stock CPU path (its own
functions, eager), verl's stock GPU path as a model of its kernels' allocations (projected, see
:class:`_FlashCrossEntropy`), and zorro's modes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

#: The tiny model: logits dominate (V x 4 bytes = 128 KiB per row against 64-wide activations).
MODEL = dict(vocab_size=32768, hidden=64, layers=2, heads=4)
#: Response-heavy batch (R >= P): 16 rows, 4 prompts x 4 rollouts, prompt 32, response 64 tokens (lengths vary).
BATCH = dict(batch_size=16, num_prompts=4, prompt_len=32, response_len=64)
#: The same micro-batch for both engines (rows), and one dynamic token budget for both.
MICRO_BATCH, TOKEN_BUDGET = 8, 640
#: (engine, rows per logits chunk of the zorro modes, torch.compile of the stock entropy): verl's stock engine with
#: its default (compiled entropy) and without; zorro's default ``none`` (``compute`` is the same computation: row
#: blocks of at most 1024 rows and 1/LEAN_BLOCKS of the rows) and the memory mode with the default chunk (1024 rows:
#: one chunk here) and with 64-row chunks.
VARIANTS = (("stock", 0, True), ("stock", 0, False), ("none", 1024, False), ("memory", 1024, False),
            ("memory", 64, False))
QUICK = dict(batch=dict(batch_size=8, num_prompts=2, prompt_len=32, response_len=64), micro_batch=8,
             phases=("train",), batchings=("micro_batch",),
             variants=(("stock", 0, True), ("none", 1024, False), ("memory", 64, False)))


def save_model(path: str) -> None:
    import torch

    from zorro_verl.testing import tiny_model

    m = MODEL
    model = tiny_model("qwen3", dtype=torch.float32, seed=0, vocab_size=m["vocab_size"], hidden=m["hidden"],
                       layers=m["layers"], heads=m["heads"], exact_norms=False)
    model.config.architectures = ["Qwen3ForCausalLM"]
    model.save_pretrained(path)


def measure_one(cfg: dict) -> dict:
    """One configuration in this (fresh) process: ``cfg`` keys ckpt, variant, phase, batching, batch, micro_batch,
    budget, chunk, and optionally dtype (``fp32`` | ``bf16``, default fp32) and compile (the stock engine's
    ``use_torch_compile``, default False). Returns the configuration plus ``peak_bytes`` and the rows per
    micro-batch."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 << 10)  # M_MMAP_THRESHOLD: fixed (disables glibc's dynamic raise), large blocks are mmapped
    libc.mallopt(-1, 128 << 10)  # M_TRIM_THRESHOLD
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(29500 + os.getpid() % 2000), VERL_ENGINE_DEVICE="cpu")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    sys.path.insert(0, str(REPO_ROOT))
    from tests.support.verl_cpu_platform import use_cpu_platform

    use_cpu_platform()
    dist.init_process_group("gloo", rank=0, world_size=1)
    from tests.support.verl_engines import build_engine, make_engine_batch, ppo_loss_fn
    from zorro_verl.bench.timing import peak_rss_bytes, reset_peak_rss, rss_bytes, trim_heap

    dynamic = cfg["batching"] == "token_budget"
    common = dict(use_dynamic_bsz=dynamic, micro_batch_size=cfg["micro_batch"], max_token_len=cfg["budget"])
    zorro = cfg["variant"] != "stock"
    engine = build_engine(cfg["ckpt"], zorro=zorro, lr=1e-4, compute_dtype=cfg.get("dtype", "fp32"),
                          use_torch_compile=cfg.get("compile", False),
                          zorro_settings={"logits_optimization": cfg["variant"]} if zorro else None, **common)
    if zorro:
        engine.logits_chunk_size = cfg["chunk"]
    td = make_engine_batch(vocab=MODEL["vocab_size"], seed=5, shuffle=True, temperature=0.9, calculate_entropy=True,
                           **cfg["batch"], **common)

    def call():
        if cfg["phase"] == "infer":
            with engine.eval_mode():
                return engine.infer_batch(td.clone(), loss_function=None)
        with engine.train_mode():
            return engine.train_batch(td.clone(), loss_function=ppo_loss_fn())

    call()  # warm-up: optimizer state, lazy initialisation
    trim_heap()
    if not reset_peak_rss():
        raise RuntimeError("/proc/self/clear_refs is not writable here; the peak RSS cannot be reset")
    base = rss_bytes()
    out = call()
    peak = peak_rss_bytes() - base
    mask = td["response_mask"].bool()
    seq = td["input_ids"].offsets().diff()
    if zorro:
        mbs = engine.zorro_last_micro_batches.batches
        assert out["metrics"]["zorro/fallback_batches"] == [0.0], out["metrics"]["zorro/fallback_batches"]
        logit_rows = max(int(mask[mb].sum()) for mb in mbs)  # the head runs at response-predicting rows only
        resp_rows = logit_rows
    else:  # stock: logits at every token of the micro-batch
        from verl.workers.engine.utils import prepare_micro_batches

        tu_td = td.clone()
        mbs_td, idx = prepare_micro_batches(tu_td, dp_group=None)
        idx = idx if idx is not None else [list(range(i * len(m), (i + 1) * len(m))) for i, m in enumerate(mbs_td)]
        logit_rows = max(int(seq[list(b)].sum()) for b in idx)
        resp_rows = max(int(mask[list(b)].sum()) for b in idx)
    dist.destroy_process_group()
    return {**{k: cfg[k] for k in ("variant", "phase", "batching", "chunk")}, "dtype": cfg.get("dtype", "fp32"),
            "compile": bool(cfg.get("compile", False)), "peak_bytes": int(peak),
            "logit_rows": logit_rows, "response_rows": resp_rows, "vocab": MODEL["vocab_size"]}


def run_config(cfg: dict, timeout: int = 600) -> dict:
    """:func:`measure_one` in a fresh subprocess (the peak of one process says nothing about the next)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--one", json.dumps(cfg)], cwd=REPO_ROOT,
                       env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"configuration {cfg} failed:\n{p.stderr[-4000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def configs(ckpt: str, quick: bool = False, dtype: str = "bf16") -> list[dict]:
    q = QUICK if quick else dict(batch=BATCH, micro_batch=MICRO_BATCH, phases=("infer", "train"),
                                  batchings=("micro_batch", "token_budget"), variants=VARIANTS)
    return [dict(ckpt=ckpt, variant=v, phase=ph, batching=bt, batch=q["batch"], micro_batch=q["micro_batch"],
                 budget=TOKEN_BUDGET, chunk=c, dtype=dtype, compile=comp)
            for bt in q["batchings"] for ph in q["phases"] for v, c, comp in q["variants"]]


def run_configs(cfgs: list[dict], jobs: int = 2) -> list[dict]:
    """:func:`run_config` over ``cfgs``, ``jobs`` subprocesses at a time (each is single-threaded and measures only
    itself), results in order."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(jobs) as pool:
        return list(pool.map(run_config, cfgs))


def _engine_name(r: dict) -> str:
    if r["variant"] == "stock":
        return "stock (compiled entropy, default)" if r.get("compile") else "stock (use_torch_compile=false)"
    if r["variant"] in ("none", "compute"):
        return "zorro none = compute (default)"
    return f"zorro {r['variant']} (chunk {r['chunk']})"


def table(rows: list[dict]) -> str:
    """The engine table; "vs stock" is against the stock engine's default path (compiled entropy) where measured."""
    lines = ["| batching | phase | engine | peak RSS delta (MiB) | vs stock | logits rows / micro-batch | "
             "bytes / logits row | bytes / response row |", "|---|---|---|---:|---:|---:|---:|---:|"]
    stock = {}
    for r in sorted((r for r in rows if r["variant"] == "stock"), key=lambda r: r.get("compile", False)):
        stock[(r["batching"], r["phase"])] = r["peak_bytes"]  # the compiled (default) one last: it wins
    for r in rows:
        ref = stock.get((r["batching"], r["phase"]))
        name = _engine_name(r)
        lines.append(f"| {r['batching']} | {r['phase']} | {name} | {r['peak_bytes'] / 2**20:.1f} | "
                     f"{r['peak_bytes'] / ref:.2f} | {r['logit_rows']} | {r['peak_bytes'] / r['logit_rows']:,.0f} | "
                     f"{r['peak_bytes'] / r['response_rows']:,.0f} |")
    return "\n".join(lines)


#: Head-level shape (``--bytes``): N rows of V-wide bf16 logits, head width H. Both ratios are the projection's
#: (16,384 response rows of Qwen3-8B, hidden 4,096, DEFAULT_CHUNK = 1024): zorro's row blocks are 1/16 of the rows
#: (none / compute: N / LEAN_BLOCKS; memory: chunk 64) and N / H = 4, so that the memory mode's figure, which
#: includes its V x H weight-gradient accumulation (it is measured from the hidden states), scales right. The other
#: paths start from the logits: their head's own weight gradient (bf16, 2 bytes per V x H element, alike for all) is
#: not in their figures.
HEAD = dict(rows=1024, vocab=32768, hidden=256, chunk=64)
#: The projection: Qwen3-8B (V = 151,936, hidden 4,096), a micro-batch of 8 rows x (4,096 prompt + 2,048 response)
#: tokens; stock runs the head on every token, zorro on the response-predicting rows.
QWEN3_8B = dict(vocab=151936, hidden=4096, rows=8, prompt=4096, response=2048)
#: Head paths of the ``--bytes`` table (:func:`head_bytes`).
HEAD_PATHS = ("stock_gpu", "stock_cpu", "none", "memory")


def _per_row(fn, x):
    """``fn`` over the rows of ``x [n, V]`` one at a time, concatenated (the one-row temporaries of a model of a
    fused kernel, which reduces each row in registers: negligible next to ``[n, V]``)."""
    import torch

    return torch.cat([fn(x[i:i + 1]) for i in range(x.shape[0])])


def _flash_ce_class():
    import torch

    class _FlashCrossEntropy(torch.autograd.Function):
        """A model of the allocations of flash-attn's Triton cross-entropy (``flash_attn.ops.triton.cross_entropy``,
        verl's GPU log-prob path ``logprobs_from_logits_flash_attn``), not its kernel: forward reduces each row in
        registers and keeps for backward the logits themselves plus an fp32 ``lse [n]``; backward writes
        ``d logits`` into ``torch.empty_like(logits)`` — or into the logits (``inplace_backward``; verl passes False
        when it also computes the entropy). Returns the log-probs ``[n]`` fp32."""

        @staticmethod
        def forward(ctx, logits, targets, inplace):
            lse = _per_row(lambda r: torch.logsumexp(r.float(), -1), logits)
            ctx.save_for_backward(logits, targets, lse)
            ctx.inplace = inplace
            return logits.gather(-1, targets[:, None])[:, 0].float() - lse

        @staticmethod
        def backward(ctx, g):
            logits, targets, lse = ctx.saved_tensors
            d = logits if ctx.inplace else torch.empty_like(logits)
            for i in range(logits.shape[0]):
                p = (logits[i].float() - lse[i]).exp()
                p[targets[i]] -= 1
                d[i] = (p * -g[i]).to(d.dtype)
            return d, None, None

    class _FusedEntropy(torch.autograd.Function):
        """A model of the allocations of verl's ``entropy_from_logits`` compiled into fused kernels (the GPU
        default, ``use_torch_compile=True``) at its leanest: forward reduces each row in registers (output in the
        logits' dtype, as the compiled function returns), keeps the logits; backward writes ``d logits`` into one
        new tensor of the logits' dtype. (Inductor on CPU materialises one fp32 ``[n, V]`` buffer in forward: 4 bytes
        per element more, measured; so this is a lower bound of stock's GPU bytes.)"""

        @staticmethod
        def forward(ctx, logits):
            ctx.save_for_backward(logits)

            def ent(r):
                r = r.float()
                lse = torch.logsumexp(r, -1)
                return lse - (torch.softmax(r, -1) * r).sum(-1)

            return _per_row(ent, logits).to(logits.dtype)

        @staticmethod
        def backward(ctx, g):
            (logits,) = ctx.saved_tensors
            d = torch.empty_like(logits)
            for i in range(logits.shape[0]):
                r = logits[i].float()
                p = torch.softmax(r, -1)
                s = (p * r).sum()
                d[i] = (-p * (r - s) * g[i].float()).to(d.dtype)
            return d

    return _FlashCrossEntropy, _FusedEntropy


def head_bytes(path: str, phase: str, *, rows: int, vocab: int, hidden: int, temperature: float, chunk: int,
               seed: int = 0) -> int:
    """Peak bytes one head pass allocates beyond its inputs (:class:`~zorro_verl.bench.timing.LiveTensorBytes`),
    bf16, log-probs and entropy (``phase="train"``: and their gradient w.r.t. the logits, or for ``memory`` w.r.t.
    the hidden states and the head's weight). Inputs, made before counting: logits ``[rows, vocab]`` bf16 (random
    hidden ``[rows, hidden]`` and weight ``[vocab, hidden]`` for ``memory``, which never materialises them).

    ``path``: ``stock_cpu`` — verl 0.9's engine on CPU, its own functions: ``logits / temperature.to(bf16)`` (at
    ``temperature != 1``, ``_scale_logits_by_temperature``), ``entropy_from_logits`` (eager: the tracker cannot
    see compiled code), ``logprobs_from_logits(..., inplace_backward=False)``; ``stock_gpu`` — the same with the
    models of flash-attn's cross-entropy and the fused entropy (:func:`_flash_ce_class`): projected, not measured
    on a GPU; ``none`` / ``compute`` (blocks of at most ``chunk`` rows) / ``memory`` (``chunk`` rows) — zorro as
    the verl 0.9 engine calls it (the temperature divides each block in bf16, ``temperature_op="logits_rounded"``)."""
    import torch
    import verl.utils.torch_functional as vF

    from zorro_verl.bench.timing import LiveTensorBytes
    from zorro_verl.logprob import linear_logprobs, logits_logprobs

    g = torch.Generator().manual_seed(seed)
    bf = torch.bfloat16
    train = phase == "train"
    targets = torch.randint(0, vocab, (rows,), generator=g)
    w1, w2 = torch.randn(rows, generator=g), torch.randn(rows, generator=g)
    if path == "memory":
        hidden_ = torch.randn(rows, hidden, generator=g).to(bf).requires_grad_(train)
        weight = (torch.randn(vocab, hidden, generator=g) / hidden ** 0.5).to(bf).requires_grad_(train)
        inputs = [hidden_, weight]
    else:
        base = (3 * torch.randn(rows, vocab, generator=g)).to(bf).requires_grad_(train)
        inputs = [base]

    def forward():
        if path == "memory":
            return linear_logprobs(hidden_, weight, None, targets, temperature=temperature, calculate_entropy=True,
                                   chunk_size=chunk, temperature_op="logits_rounded")
        # a view: the logits are the output of a graph node (the head), not a leaf, as in the engine — the
        # gradients of the log-probs and the entropy then meet in that node's input buffer (summed in place)
        logits = base.view(rows, vocab)
        if path in ("none", "compute"):
            return logits_logprobs(logits, targets, temperature=temperature, calculate_entropy=True,
                                   logits_optimization=path, chunk_size=chunk, temperature_op="logits_rounded")
        z = logits
        if temperature != 1.0:  # verl's _scale_logits_by_temperature with the per-token fp32 temperature
            t = torch.full((rows, 1), temperature, dtype=torch.float32)
            z = z / t.clamp(min=1e-8).to(z.dtype)
        if path == "stock_cpu":
            return vF.logprobs_from_logits(z, targets, inplace_backward=False), vF.entropy_from_logits(z)
        ce, ent = _flash_ce_class()
        return ce.apply(z, targets, False), ent.apply(z)

    meter = LiveTensorBytes()
    with torch.set_grad_enabled(train), meter:
        lp, ent = forward()
        if train:
            torch.autograd.grad((lp.float() * w1 + ent.float() * w2).sum(), inputs)
        del lp, ent
    return meter.peak


def bytes_rows(temperatures=(0.7, 1.0)) -> list[dict]:
    """:func:`head_bytes` of every path in :data:`HEAD_PATHS`, both phases, each temperature, at :data:`HEAD`."""
    h = HEAD
    out = []
    for temperature in temperatures:
        for phase in ("infer", "train"):
            for path in HEAD_PATHS:
                chunk = 1024 if path == "none" else h["chunk"]  # none: the default chunk (DEFAULT_CHUNK)
                peak = head_bytes(path, phase, rows=h["rows"], vocab=h["vocab"], hidden=h["hidden"],
                                  temperature=temperature, chunk=chunk)
                out.append(dict(path=path, phase=phase, temperature=temperature, peak_bytes=peak,
                                bytes_per_element=peak / (h["rows"] * h["vocab"])))
    return out


_PATH_NAMES = {"stock_gpu": "stock GPU (flash-attn CE + fused entropy; projected)",
               "stock_cpu": "stock CPU (verl's functions, eager)", "none": "zorro none = compute (default)",
               "compute": "zorro compute", "memory": "zorro memory (chunk N/16)"}


def bytes_table(rows: list[dict]) -> str:
    """Bytes per logits element beyond the bf16 logits (measured at :data:`HEAD`) and the Qwen3-8B projection: that
    figure times the micro-batch's logits elements (stock: every token; zorro: the response-predicting rows), plus
    the logits themselves (2 bytes per element; none for the memory mode, which holds one chunk)."""
    q = QWEN3_8B
    stock_rows, zorro_rows = q["rows"] * (q["prompt"] + q["response"]), q["rows"] * q["response"]
    lines = ["| path | T | phase | bytes / logits element beyond the logits (measured, CPU bf16) | "
             "Qwen3-8B micro-batch: logits rows | head peak, logits included (GB, projected) |",
             "|---|---:|---|---:|---:|---:|"]
    for r in rows:
        n = stock_rows if r["path"].startswith("stock") else zorro_rows
        logits = 0 if r["path"] == "memory" else 2
        gb = n * q["vocab"] * (r["bytes_per_element"] + logits) / 1e9
        lines.append(f"| {_PATH_NAMES[r['path']]} | {r['temperature']} | {r['phase']} | "
                     f"{r['bytes_per_element']:.2f} | {n:,} | {gb:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="one small configuration (train, same micro-batch)")
    ap.add_argument("--json", help="write the rows to this file")
    ap.add_argument("--jobs", type=int, default=2, help="configurations measured at a time (default 2)")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                    help="the engines' compute dtype (bf16: verl's default mixed precision; default bf16)")
    ap.add_argument("--bytes", action="store_true",
                    help="the head-level bytes per logits element and the Qwen3-8B projection instead")
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(measure_one(json.loads(args.one))))
        return 0
    sys.path.insert(0, str(REPO_ROOT))
    if args.bytes:
        import torch

        torch.set_num_threads(1)
        rows = bytes_rows()
        print(bytes_table(rows))
    else:
        with tempfile.TemporaryDirectory() as d:
            save_model(d)
            rows = run_configs(configs(d, quick=args.quick, dtype=args.dtype), jobs=args.jobs)
        print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
