"""One rank of the step-level Ulysses check (tests/integrations/transformers/test_ulysses_step.py): ``zorro_step``
with an :class:`~zorro_verl.packing.ulysses.UlyssesShard` on every rank of an SP group against ``zorro_step`` of the
whole packed row on one rank, no verl involved.

Run as ``python -m tests.support.ulysses_step RANK WORLD INIT_FILE DEVICE OUT_JSON`` (``DEVICE``: ``cpu`` = fp64 over
gloo with the ``sdpa`` backend; ``cuda`` = bf16 over NCCL with the ``flash`` backend, plus an fp64 ``sdpa`` oracle for
the relative rule). Models: tiny Qwen3s with 4 query / 2 KV heads and with 2 query / 1 KV head (fewer KV heads than
SP ranks when ``WORLD = 2``), on CPU also tiny gpt-oss (sliding windows, attention sinks) and Gemma 2 (windows,
soft-capping); the batch has 3 shuffled prompts, a 1-token and an empty response and an odd packed
length. Loss ``sum(w1 * log_probs) + sum(w2 * entropy)`` with fixed random weights; the SP gradient is the SP
group's sum divided by ``WORLD`` (the row gather scales by SP, as verl's does, for FSDP's averaging).
"""

from __future__ import annotations

import os

__all__ = ["run_rank"]


def _errors(ref: dict, got: dict) -> dict:
    """Relative errors (Frobenius) of log-probs, entropy and the whole gradient of ``got`` against ``ref``."""
    import torch

    def rel(a, b):
        return ((a.double() - b.double()).norm() / a.double().norm().clamp_min(1e-30)).item()

    ga = torch.cat([g.double().flatten() for g in ref["grads"].values()])
    gb = torch.cat([got["grads"][k].double().flatten() for k in ref["grads"]])
    return {"log_probs": rel(ref["logp"], got["logp"]), "entropy": rel(ref["ent"], got["ent"]), "grads": rel(ga, gb),
            "log_probs_max_abs": (ref["logp"].double() - got["logp"].double()).abs().max().item()}


def run_rank(rank: int, world: int, init_file: str, device: str) -> dict:
    os.environ.update(OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    from zorro_verl.integrations.transformers import install_zorro, zorro_step
    from zorro_verl.packing import build_plan
    from zorro_verl.packing.ulysses import ulysses_shard
    from zorro_verl.testing import create_dummy_batch, tiny_model
    from zorro_verl.testing.models import tiny_window_model

    dev = torch.device(device, rank) if cuda else torch.device("cpu")
    b = create_dummy_batch(batch_size=7, num_unique_prompts=3, prompt_len=6, response_len=5, device="cpu",
                           add_padding=True, vocab_size=128, seed=4, shuffle=True)
    plan = build_plan(b["input_ids"].to(dev), b["attention_mask"].to(dev), 5)
    gen = torch.Generator().manual_seed(1)
    w1, w2 = (torch.randn(plan.N, generator=gen, dtype=torch.float64).to(dev) for _ in range(2))
    res = {"T": plan.T, "N": plan.N, "response_lens": sorted(plan.response_lens.tolist())}

    def step(model, backend, shard, mode):
        model.zero_grad(set_to_none=True)
        logp, ent = zorro_step(model, plan, backend=backend, temperature=0.7, calculate_entropy=True,
                               logits_optimization=mode, chunk_size=3, shard=shard)
        ((logp.double() * w1).sum() + (ent.double() * w2).sum()).backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        if shard is not None:  # the SP group's partial gradients add up to sp x the gradient (see module doc)
            for g in grads.values():
                dist.all_reduce(g)
                g /= world
        return {"logp": logp.detach(), "ent": ent.detach(), "grads": grads}

    for heads in (4, 2):  # (Hq, Hkv) = (4, 2), (2, 1)
        out = {}
        models = {}
        for dtype in ((torch.float64, torch.bfloat16) if cuda else (torch.float64,)):
            m = tiny_model("qwen3", dtype=dtype, seed=0, heads=heads).to(dev)
            install_zorro(m)
            models[dtype] = m
        shard = ulysses_shard(plan, world, rank, dist.group.WORLD)
        out["kv_heads"] = models[torch.float64].config.num_key_value_heads
        out["rows_per_rank"] = list(shard.row_counts)
        for mode in ("none", "memory"):
            if cuda:
                oracle = step(models[torch.float64], "sdpa", None, mode)
                ref = step(models[torch.bfloat16], "flash", None, mode)
                got = step(models[torch.bfloat16], "flash", shard, mode)
                out[mode] = {"ref_vs_oracle": _errors(oracle, ref), "sp_vs_oracle": _errors(oracle, got)}
            else:
                ref = step(models[torch.float64], "sdpa", None, mode)
                got = step(models[torch.float64], "sdpa", shard, mode)
                out[mode] = {"sp_vs_ref": _errors(ref, got)}
        res[f"heads{heads}"] = out
    if not cuda:
        # attention features under SP: gpt-oss (sliding windows, per-head sinks, sliced to each rank's heads, with
        # their gradient) and Gemma 2 (windows, logit soft-capping; its final-logit soft-cap rules out memory mode)
        for kind, modes in (("gpt_oss", ("none", "memory")), ("gemma2", ("none",))):
            m = tiny_window_model(kind, dtype=torch.float64, seed=0, window=4)
            install_zorro(m)
            shard = ulysses_shard(plan, world, rank, dist.group.WORLD)
            res[kind] = {mode: {"sp_vs_ref": _errors(step(m, "sdpa", None, mode), step(m, "sdpa", shard, mode))}
                         for mode in modes}
    dist.barrier()
    dist.destroy_process_group()
    return res


if __name__ == "__main__":
    from tests.support.multi_rank import rank_main

    rank_main(run_rank, str)
