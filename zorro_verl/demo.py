"""``zorro-verl demo``: the ordinary vs the ZoRRo forward+backward of one GRPO-shaped micro-batch, side by side.

Builds a Qwen3-shaped model from a config (or loads ``--model PATH``), a batch of B rows sharing G prompts, runs
the ordinary padded forward as verl does (full logits) and the deduplicated one, and prints the token counts, the
ideal speedup, the largest log-prob / entropy / loss / gradient differences and the median times. Exits 1 when a
difference exceeds the tolerance of the dtype.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time

import torch

from zorro_verl.api import packed_ppo_policy_loss
from zorro_verl.attention import available_backends
from zorro_verl.integrations.transformers import install_zorro, load_causal_lm, zorro_step
from zorro_verl.logprob import LOGITS_MODES
from zorro_verl.packing import build_plan
from zorro_verl.testing import (
    create_dummy_batch,
    exact_fp64_norms,
    grads_of,
    max_rel_grad_error,
    ordinary_logprobs_padded,
    tiny_model,
)

TOLERANCE = {torch.float64: 1e-9, torch.float32: 2e-4}
_DTYPES = {"float64": torch.float64, "float32": torch.float32}


def _parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = p or argparse.ArgumentParser(prog="zorro-verl demo", description=__doc__)
    p.add_argument("--model", default=None, help="local model directory (default: a Qwen3 built from a config)")
    p.add_argument("--batch-size", "-B", type=int, default=8)
    p.add_argument("--groups", "-G", type=int, default=2, help="unique prompts in the batch")
    p.add_argument("--prompt-len", "-P", type=int, default=256)
    p.add_argument("--response-len", "-R", type=int, default=32)
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="float64")
    p.add_argument("--attn", default="sdpa", choices=available_backends("cpu"),
                   help="attention backend of zorro's split attention (those that train on this CPU)")
    p.add_argument("--logits", default="none", choices=list(LOGITS_MODES), help="logits_optimization")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per path (median reported)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    return p


def _model(args, dtype):
    if args.model:
        model = load_causal_lm(args.model, dtype=dtype)
        if dtype == torch.float64:
            exact_fp64_norms(model)
        return model
    return tiny_model("qwen3", dtype=dtype, seed=args.seed, layers=args.layers, hidden=args.hidden,
                      heads=max(2, args.hidden // 32), vocab_size=2048)


def _loss(lp, batch, valid, sel):
    pick = lambda k: batch[k][valid][sel]  # noqa: E731
    return packed_ppo_policy_loss(lp[sel], pick("old_log_probs"), pick("advantages"), pick("ref_log_prob"))[0]


def run(args) -> dict:
    torch.manual_seed(args.seed)
    dtype = _DTYPES[args.dtype]
    ref = _model(args, dtype)
    zor = copy.deepcopy(ref)
    if dtype == torch.float64:  # deepcopy keeps the bound oracle methods pointing at `ref`: re-bind on the copy
        exact_fp64_norms(zor)
    install_zorro(zor)
    ref.train()
    zor.train()
    vocab = ref.get_input_embeddings().weight.shape[0]
    batch = create_dummy_batch(args.batch_size, args.groups, args.prompt_len, args.response_len, device="cpu",
                               include_training_fields=True, add_padding=True, shuffle=True, vocab_size=vocab,
                               seed=args.seed)
    R = args.response_len
    valid = batch["attention_mask"][:, -R:].bool()
    sel = batch["response_mask"][valid].bool()

    def ordinary():
        ref.zero_grad(set_to_none=True)
        lp, ent = ordinary_logprobs_padded(ref, batch["input_ids"], batch["attention_mask"], batch["position_ids"],
                                           R, temperature=args.temperature, calculate_entropy=True)
        if dtype == torch.float64:
            lp, ent = lp.double(), ent.double()
        lp, ent = lp[valid], ent[valid]
        _loss(lp, batch, valid, sel).backward()
        return lp.detach(), ent.detach()

    def zorro():
        zor.zero_grad(set_to_none=True)
        plan = build_plan(batch["input_ids"], batch["attention_mask"], R, position_ids=batch["position_ids"])
        lp, ent = zorro_step(zor, plan, backend=args.attn, temperature=args.temperature, calculate_entropy=True,
                             logits_optimization=args.logits)
        _loss(lp, batch, valid, sel).backward()
        return lp.detach(), ent.detach(), plan

    def timed(fn):
        fn()  # warm-up
        ts = []
        for _ in range(max(1, args.repeats)):
            t0 = time.perf_counter()
            out = fn()
            ts.append(time.perf_counter() - t0)
        return out, 1000 * statistics.median(ts)

    (lp_o, ent_o), t_o = timed(ordinary)
    (lp_z, ent_z, plan), t_z = timed(zorro)
    grad_err, worst = max_rel_grad_error(grads_of(ref), grads_of(zor))
    res = {
        "B": args.batch_size, "G": plan.G, "P": args.prompt_len, "R": R, "dtype": args.dtype,
        "tokens_padded": int(batch["input_ids"].numel()), "tokens_ordinary": plan.ordinary_tokens,
        "tokens_dedup": plan.T, "ideal_speedup": plan.ordinary_tokens / plan.T,
        "max_abs_logprob_diff": (lp_o - lp_z).abs().max().item(),
        "max_abs_entropy_diff": (ent_o - ent_z).abs().max().item(),
        "max_rel_grad_err": grad_err, "worst_param": worst,
        "ordinary_ms": t_o, "zorro_ms": t_z, "measured_speedup": t_o / t_z,
        "tolerance": TOLERANCE[dtype], "threads": torch.get_num_threads(),
    }
    res["ok"] = max(res["max_abs_logprob_diff"], res["max_abs_entropy_diff"], grad_err) <= TOLERANCE[dtype]
    return res


def format_table(r: dict) -> str:
    rows = [
        ("batch", f"B={r['B']} rows, G={r['G']} unique prompts, P={r['P']}, R={r['R']} ({r['dtype']})"),
        ("tokens ordinary -> dedup", f"{r['tokens_ordinary']} -> {r['tokens_dedup']} (padded batch: "
                                     f"{r['tokens_padded']})"),
        ("ideal speedup (tokens)", f"{r['ideal_speedup']:.2f}x"),
        ("max |d log-prob|", f"{r['max_abs_logprob_diff']:.2e}"),
        ("max |d entropy|", f"{r['max_abs_entropy_diff']:.2e}"),
        ("max rel grad error", f"{r['max_rel_grad_err']:.2e} (all parameters; worst {r['worst_param']})"),
        ("ordinary fwd+bwd (median)", f"{r['ordinary_ms']:.1f} ms  (verl-style padded batch, full logits)"),
        ("zorro fwd+bwd (median)", f"{r['zorro_ms']:.1f} ms"),
        ("measured speedup", f"{r['measured_speedup']:.2f}x  (CPU, {r['threads']} threads)"),
        ("result", ("MATCH" if r["ok"] else "MISMATCH") + f" (tolerance {r['tolerance']:.0e})"),
    ]
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    for name in ("batch_size", "groups", "prompt_len", "repeats"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(args, name)}")
    res = run(args)
    print(format_table(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
