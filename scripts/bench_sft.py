"""verl's SFT step on the zorro FSDP engine vs the stock engine, on multi-turn SFT data (docs/BENCHMARKS.md, "SFT
with prefix sharing").

    python scripts/bench_sft.py                  # the default scenario, markdown table
    python scripts/bench_sft.py --reps 3 --quick # a smaller batch (CI-sized)
    python scripts/bench_sft.py --json out.json

What runs: verl 0.9.1's real FSDP2 engine on CPU (1-rank gloo, the test CPU platform from tests/support, fp32), the
``quick`` model shape of the benchmarks (Qwen3: hidden 256, 4 layers, GQA 4/2, vocabulary 4096, untied head), and the
step verl's SFT trainer runs per batch: ``train_batch`` with verl's ``sft_loss`` on the batch its ``fit`` loop builds
(verl's ``SFTTensorCollator`` in ``no_padding`` mode, dynamic micro-batches of ``--token-budget`` tokens, 1024 by
default: without flash-attn verl's packed micro-batch runs transformers' sdpa with a dense block-diagonal mask over
the micro-batch, quadratic in its tokens, so a large budget would inflate the stock time), including
the optimizer step. The data (:func:`zorro_verl.testing.sft_conversations`): ``--conversations`` conversations of
``--turns`` (user, assistant) turns behind one ``--system``-token system prompt, each cut after every assistant turn
(one sample per turn: sample ``i`` repeats turns ``< i``), the loss over every assistant token.

Variants, interleaved run by run on the same batches: ``stock`` (``FSDPEngineWithLMHead``), ``prompt`` (zorro,
``sharing=prompt``: rows with the same tokens before their first assistant token computed once) and ``prefix``
(zorro, ``sharing=prefix``: the prefix tree, the system prompt and every earlier turn once). Reported per variant:
the median step time over ``--reps`` timed runs (after ``--warmup``), the speed-up over ``stock``, the tokens the
engine ran (``zorro/computed_tokens``; stock: every token of every sample), the ideal speed-up from token counts
(ordinary tokens / computed tokens) and the efficiency (speed-up / ideal). The token ideal ignores that attention
grows with context and that zorro runs the LM head only from each sample's first assistant token on, so an
efficiency above 1 is possible.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("stock", "prompt", "prefix")


def _engines(ckpt: str, token_budget: int) -> dict:
    from tests.support.verl_engines import build_engine

    optim = {"optimizer": "SGD", "lr": 1e-4}
    kw = dict(strategy="fsdp2", use_dynamic_bsz=True, max_token_len=token_budget, optim_overrides=optim)
    return {"stock": build_engine(ckpt, zorro=False, **kw),
            "prompt": build_engine(ckpt, zorro=True, zorro_settings={"sharing": "prompt"}, **kw),
            "prefix": build_engine(ckpt, zorro=True, zorro_settings={"sharing": "prefix"}, **kw)}


def run(args) -> dict:
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", VERL_ENGINE_DEVICE="cpu")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(REPO_ROOT))
    from tests.support.verl_cpu_platform import use_cpu_platform

    use_cpu_platform()
    tmp = tempfile.mkdtemp(prefix="zorro-bench-sft-")
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1)
    import verl.workers.engine  # noqa: F401  (registers the zorro engine)

    from tests.support.verl_engines import sft_batch, sft_loss_fn
    from zorro_verl.bench.models import build_model
    from zorro_verl.testing import sft_conversations

    model = build_model("quick", dtype=torch.float32, device="cpu", seed=0)
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(f"{tmp}/ckpt")
    engines = _engines(f"{tmp}/ckpt", args.token_budget)
    batches = []
    for k in range(2):  # two batches in turn (another sample order each)
        samples = sft_conversations(args.conversations, args.turns, system_len=args.system, user_len=args.user,
                                    assistant_len=args.assistant, vocab_size=4096, seed=k)
        order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(100 + k)).tolist()
        batches.append([samples[i] for i in order])
    ordinary = sum(s["input_ids"].numel() for s in batches[0])
    times = {v: [] for v in VARIANTS}
    computed = {"stock": float(ordinary)}
    loss_fn = sft_loss_fn()
    for i in range(args.warmup + args.reps):
        samples = batches[i % len(batches)]
        for v in VARIANTS[i % 3:] + VARIANTS[:i % 3]:  # rotate the order run by run
            td = sft_batch(samples, dynamic=True, max_tok=args.token_budget)
            eng = engines[v]
            with eng.train_mode():
                t0 = time.perf_counter()
                out = eng.train_batch(td, loss_function=loss_fn)
                t1 = time.perf_counter()
            if i >= args.warmup:
                times[v].append(t1 - t0)
            if v != "stock" and i % len(batches) == 0:
                m = out["metrics"]
                assert m["zorro/fallback_batches"] == [0.0], m
                computed[v] = sum(m["zorro/computed_tokens"])
    med = {v: statistics.median(times[v]) for v in VARIANTS}
    rows = []
    for v in VARIANTS:
        speedup = med["stock"] / med[v]
        ideal = ordinary / computed[v]
        rows.append({"variant": v, "median_s": med[v], "times_s": times[v], "speedup": speedup,
                     "tokens": computed[v], "ideal": ideal, "efficiency": speedup / ideal})
    dist.destroy_process_group()
    return {"scenario": {k: getattr(args, k) for k in ("conversations", "turns", "system", "user", "assistant",
                                                      "token_budget", "reps", "warmup", "threads")},
            "samples": len(batches[0]), "ordinary_tokens": ordinary, "rows": rows,
            "torch_threads": torch.get_num_threads()}


def table(res: dict) -> str:
    lines = ["| variant | median step (s) | speed-up | tokens run | ideal (tokens) | efficiency |",
             "|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['variant']} | {r['median_s']:.3f} | {r['speedup']:.2f}x | {r['tokens']:.0f} | "
                     f"{r['ideal']:.2f}x | {r['efficiency']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system", type=int, default=256, help="system prompt tokens")
    p.add_argument("--user", type=int, default=32, help="tokens per user turn")
    p.add_argument("--assistant", type=int, default=64, help="tokens per assistant turn")
    p.add_argument("--token-budget", type=int, default=1024, help="max_token_len_per_gpu (dynamic micro-batches)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="2 conversations x 3 turns, a 128-token system prompt")
    p.add_argument("--json", type=str, default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.conversations, args.turns, args.system = 2, 3, 128
    res = run(args)
    print(f"SFT step, {res['samples']} samples, {res['ordinary_tokens']} tokens "
          f"({args.conversations} conversations x {args.turns} turns, system {args.system}, user {args.user}, "
          f"assistant {args.assistant}), fp32, {res['torch_threads']} threads, median of {args.reps}:")
    print(table(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
