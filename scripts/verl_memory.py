"""Logits memory of the zorro engine vs verl 0.9's stock FSDP engine on CPU (docs/BENCHMARKS.md, "Logits memory vs
the stock verl engine").

    python scripts/verl_memory.py                 # the full table (every mode, infer + train, two batchings)
    python scripts/verl_memory.py --quick         # one small configuration
    python scripts/verl_memory.py --json out.json

Each configuration runs in a fresh subprocess: verl's real engine (FSDP2, fp32, 1-rank gloo, the test CPU platform
from tests/support), a tiny untied Qwen3 with a 32K vocabulary (so the LM head dominates), one warm-up call, then the
measured call (``infer_batch`` with entropy, or ``train_batch`` with entropy and verl's PPO loss). Memory: the peak
RSS delta of that call — VmHWM (/proc/self/status) after resetting it through /proc/self/clear_refs, minus the RSS
before the call — with glibc's mmap threshold fixed at 64 KiB and trimming at 128 KiB, so that freed tensors go back
to the OS and RSS follows live memory.
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
#: (engine, rows per logits chunk of the zorro modes): verl's stock engine, zorro's three modes at the default chunk
#: (1024 rows: one chunk here), and the memory mode with 64-row chunks.
VARIANTS = (("stock", 0), ("none", 1024), ("compute", 1024), ("memory", 1024), ("memory", 64))
QUICK = dict(batch=dict(batch_size=8, num_prompts=2, prompt_len=32, response_len=64), micro_batch=8,
             phases=("train",), batchings=("micro_batch",), variants=(("stock", 0), ("none", 1024), ("memory", 64)))


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
    budget, chunk. Returns the configuration plus ``peak_bytes`` and the rows per micro-batch."""
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
    engine = build_engine(cfg["ckpt"], zorro=zorro, lr=1e-4,
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
    return {**{k: cfg[k] for k in ("variant", "phase", "batching", "chunk")}, "peak_bytes": int(peak),
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


def configs(ckpt: str, quick: bool = False) -> list[dict]:
    q = QUICK if quick else dict(batch=BATCH, micro_batch=MICRO_BATCH, phases=("infer", "train"),
                                  batchings=("micro_batch", "token_budget"), variants=VARIANTS)
    return [dict(ckpt=ckpt, variant=v, phase=ph, batching=bt, batch=q["batch"], micro_batch=q["micro_batch"],
                 budget=TOKEN_BUDGET, chunk=c)
            for bt in q["batchings"] for ph in q["phases"] for v, c in q["variants"]]


def run_configs(cfgs: list[dict], jobs: int = 2) -> list[dict]:
    """:func:`run_config` over ``cfgs``, ``jobs`` subprocesses at a time (each is single-threaded and measures only
    itself), results in order."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(jobs) as pool:
        return list(pool.map(run_config, cfgs))


def table(rows: list[dict]) -> str:
    lines = ["| batching | phase | engine | peak RSS delta (MiB) | vs stock | logits rows / micro-batch | "
             "bytes / logits row | bytes / response row |", "|---|---|---|---:|---:|---:|---:|---:|"]
    stock = {(r["batching"], r["phase"]): r["peak_bytes"] for r in rows if r["variant"] == "stock"}
    for r in rows:
        ref = stock.get((r["batching"], r["phase"]))
        name = "stock" if r["variant"] == "stock" else f"zorro {r['variant']} (chunk {r['chunk']})"
        lines.append(f"| {r['batching']} | {r['phase']} | {name} | {r['peak_bytes'] / 2**20:.1f} | "
                     f"{r['peak_bytes'] / ref:.2f} | {r['logit_rows']} | {r['peak_bytes'] / r['logit_rows']:,.0f} | "
                     f"{r['peak_bytes'] / r['response_rows']:,.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="one small configuration (train, same micro-batch)")
    ap.add_argument("--json", help="write the rows to this file")
    ap.add_argument("--jobs", type=int, default=2, help="configurations measured at a time (default 2)")
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(measure_one(json.loads(args.one))))
        return 0
    sys.path.insert(0, str(REPO_ROOT))
    with tempfile.TemporaryDirectory() as d:
        save_model(d)
        rows = run_configs(configs(d, quick=args.quick), jobs=args.jobs)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
