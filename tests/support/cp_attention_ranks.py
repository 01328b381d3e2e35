"""One rank of the 2-process context-parallel attention check (tests/attention/test_context_parallel.py): gloo with
a ``file://`` rendezvous; for prompt and prefix-tree plans, with and without a sliding window and GQA, zorro's CP
split attention (keys / values all-gathered, this rank's queries at their global packed positions; the dense
``eager`` / ``sdpa`` kernels, and without a window the varlen ones: ``flash_copyfree`` on the plain-torch varlen
primitives, ``flash`` on PyTorch's CPU flash kernels) against the
single-process split attention of the whole row, fp64: this rank's outputs, its queries', keys' and values'
gradients (keys / values summed over both ranks' queries by the backward's reduce-scatter), and the bytes the
all-gather moved against :func:`~zorro_verl.packing.context_parallel.cp_kv_bytes`.

Run as ``python -m tests.support.cp_attention_ranks RANK WORLD INIT_FILE OUT_JSON``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.support.multi_rank import rank_main


def plans():
    from zorro_verl.packing import build_plan
    from zorro_verl.testing import batch_from_rows, create_dummy_batch, multi_turn_rows, shared_system_rows

    b = create_dummy_batch(batch_size=7, num_unique_prompts=3, prompt_len=9, response_len=6, device="cpu",
                           add_padding=True, vocab_size=50, seed=4, shuffle=True)
    prompt = build_plan(b["input_ids"], b["attention_mask"], 6)
    rows = shared_system_rows(2, 3, system_len=7, question_len=2, response_len=4, vocab_size=50, seed=2)
    rows[1] = (rows[1][0], rows[0][1][:2] + rows[1][1][2:])
    turns, _ = multi_turn_rows(3, first_prompt_len=4, turn_len=2, observation_len=1, vocab_size=50, seed=3)
    t = batch_from_rows(rows + turns)
    tree = build_plan(t["input_ids"], t["attention_mask"], t["responses"].shape[1], sharing="prefix",
                      min_shared_len=1)
    return {"prompt": prompt, "prefix": tree}


def run_rank(rank: int, world: int, init_file: str) -> dict:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from zorro_verl.attention import AttentionFeatures, attend
    from zorro_verl.attention.context_parallel import cp_attend
    from zorro_verl.attention.primitives import torch_primitives
    from zorro_verl.packing.context_parallel import cp_kv_bytes, cp_shard

    moved = []
    real_gather = dist.all_gather

    def counting_gather(parts, x, group=None, **kw):  # bytes this rank receives from the others
        moved.append(x.numel() * x.element_size() * (len(parts) - 1))
        return real_gather(parts, x, group=group, **kw)

    dist.all_gather = counting_gather
    out = {}
    for name, plan in plans().items():
        for hq, hkv, window in ((4, 2, None), (2, 2, 5)):
            feats = AttentionFeatures(window=window)
            g = torch.Generator().manual_seed(7)
            T, D = plan.T, 8
            q, k, v = (torch.randn(1, h, T, D, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv))
            w = torch.randn(1, T, hq, D, generator=g, dtype=torch.float64)  # the loss weights
            q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
            ref = attend(plan, "eager", q, k, v, 0.3, feats)
            (ref * w).sum().backward()
            shard = cp_shard(plan, world, rank, group=dist.group.WORLD, multiple=2)
            idx, ok = shard.index, shard.valid
            ql, kl, vl = (torch.cat([x.detach(), x.new_zeros(1, x.shape[1], 1, D)], 2)[:, :, idx].requires_grad_(True)
                          for x in (q, k, v))  # this rank's tokens, pad slots 0
            backends = ("eager", "sdpa") if window is not None else ("eager", "sdpa", "flash_copyfree", "flash")
            for backend in backends:
                ql.grad = kl.grad = vl.grad = None
                moved.clear()
                # flash_copyfree on the plain-torch varlen kernels, flash on PyTorch's CPU flash kernels (fp64)
                prims = torch_primitives() if backend == "flash_copyfree" else None
                o = cp_attend(plan, backend, shard, ql, kl, vl, 0.3, feats, prims=prims)  # [1, L, Hq, D]
                wl = torch.cat([w, w.new_zeros(1, 1, hq, D)], 1)[:, idx]
                (o * wl).sum().backward()
                key = f"{name}_h{hq}_{hkv}_w{window}_{backend}"
                err = lambda a, b: float((a - b).detach().abs().max()) if a.numel() else 0.0  # noqa: E731
                out[key] = {
                    "out": err(o[0, ok], ref[0, idx[ok]]),
                    "pad_out": float(o[0, ~ok].detach().abs().max()) if (~ok).any() else 0.0,
                    "dq": err(ql.grad[:, :, ok], q.grad[:, :, idx[ok]]),
                    "dk": err(kl.grad[:, :, ok], k.grad[:, :, idx[ok]]),
                    "dv": err(vl.grad[:, :, ok], v.grad[:, :, idx[ok]]),
                    "bytes": sum(moved),
                    "bytes_formula": cp_kv_bytes(shard.local_len, world, hkv, D, 8),
                    "local_len": shard.local_len, "T": T,
                }
            q.grad = k.grad = v.grad = None
    dist.barrier()
    return out


if __name__ == "__main__":
    rank_main(run_rank)
