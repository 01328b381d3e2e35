"""One rank of the 2-process verl 0.9 engine check (tests/integrations/verl/v09/test_two_ranks.py): FSDP2 over gloo
with a ``file://`` rendezvous, the CPU platform, an untied ``lm_head`` (verl wraps it as its own FSDP2 unit).

Run as ``python -m tests.support.verl_two_ranks RANK WORLD INIT_FILE CKPT OUT_JSON``. Each rank compares the zorro
engine (``logits_chunk_size = 4``; modes ``memory`` and ``compute``) with the stock engine on its own shard (rank 0:
8 rows of 2 prompts, rank 1: 12 rows of 3 prompts; dynamic batch size, which stock verl equalises across ranks), in
inference (log-probs, entropy) and training (loss, grad norm, gradients), then checks that a batch unsupported on
rank 0 only makes *both* ranks run the stock forward (``on_unsupported = warn``), and that a batch only one rank
cannot run (position ids off verl's layout, a token budget a row does not fit, more micro-batches than the other
rank has rows) makes both ranks raise, or both run stock (:func:`_one_rank_cannot_run`). Results go to ``OUT_JSON``.
"""

from __future__ import annotations

import os

__all__ = ["run_rank"]


def _rank_batch(rank: int):
    from tests.support.verl_engines import make_engine_batch

    if rank == 0:
        return make_engine_batch(batch_size=8, num_prompts=2, prompt_len=7, response_len=6, seed=31, shuffle=True,
                                 temperature=0.8, use_dynamic_bsz=True, max_token_len=40, global_batch_size=20)
    return make_engine_batch(batch_size=12, num_prompts=3, prompt_len=6, response_len=7, seed=32, shuffle=True,
                             temperature=0.8, use_dynamic_bsz=True, max_token_len=40, global_batch_size=20)


def _attempt(eng, td) -> dict:
    """One inference call: its ``zorro/fallback_batches``, or the exception it raised (type and message)."""
    try:
        with eng.eval_mode():
            out = eng.infer_batch(td, loss_function=None)
    except Exception as e:  # noqa: BLE001 - the caller checks which ranks raised what
        return {"error": type(e).__name__, "message": str(e)}
    return {"error": None, "fallback": out["metrics"]["zorro/fallback_batches"]}


def _one_rank_cannot_run(eng, td, rank: int) -> dict:
    """Batches that only one rank cannot run with zorro; each must stop (or send to the stock forward) every rank
    together, so that no rank waits for another in a collective (``eng``: ``on_unsupported = warn``)."""
    import torch
    from verl.utils import tensordict_utils as tu

    res = {}
    shifted = td.clone()  # rank 1: the first row's positions start at 3 instead of 0
    if rank == 1:
        pos = td["position_ids"]
        vals = pos.values().clone()
        vals[: int(pos.offsets()[1])] += 3
        shifted["position_ids"] = torch.nested.nested_tensor_from_jagged(vals, pos.offsets())
    eng.zorro.on_unsupported = "raise"
    res["positions_raise"] = _attempt(eng, shifted.clone())
    eng.zorro.on_unsupported = "warn"
    res["positions_warn"] = _attempt(eng, shifted.clone())
    small = td.clone()  # rank 0: a token budget none of its rows fits (a read error whatever on_unsupported says)
    if rank == 0:
        tu.assign_non_tensor(small, max_token_len_per_gpu=8)
    res["budget"] = _attempt(eng, small)
    many = td.clone()  # rank 1: one row per micro-batch, 12 micro-batches; rank 0 holds only 8 rows
    if rank == 1:
        tu.assign_non_tensor(many, use_dynamic_bsz=False, micro_batch_size_per_gpu=1)
    res["count"] = _attempt(eng, many)
    return res


def run_rank(rank: int, world: int, init_file: str, ckpt: str) -> dict:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      VERL_ENGINE_DEVICE="cpu", OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from tests.support.verl_cpu_platform import use_cpu_platform

    use_cpu_platform()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from verl.utils import tensordict_utils as tu

    from tests.support.verl_engines import build_engine, engine_grads, ppo_loss_fn, response_values
    from zorro_verl.testing import grad_rel_error

    td = _rank_batch(rank)
    mask = td["response_mask"].bool()

    def run(engine):
        with engine.eval_mode():
            inf = engine.infer_batch(td.clone(), loss_function=None)
        with engine.train_mode(zero_grad_on_exit=False):  # keep the grads for the comparison
            tr = engine.train_batch(td.clone(), loss_function=ppo_loss_fn())
        return inf, tr, engine_grads(engine)

    common = dict(use_dynamic_bsz=True, max_token_len=40)
    inf_s, tr_s, g_s = run(build_engine(ckpt, zorro=False, **common))
    res = {"rank": rank, "rows": int(mask.shape[0])}
    for mode in ("memory", "compute"):
        eng = build_engine(ckpt, zorro=True, zorro_settings={"logits_optimization": mode, "on_unsupported": "warn"},
                           **common)
        head = eng.module.get_output_embeddings()
        eng.logits_chunk_size = 4
        consensus = None
        if mode == "memory":
            # a batch only rank 0 cannot run with zorro: both ranks must take the stock path (no hang)
            bad = td.clone()
            if rank == 0:
                tu.assign_non_tensor(bad, calculate_sum_pi_squared=True)
            with eng.eval_mode():
                consensus = eng.infer_batch(bad, loss_function=None)
            res["one_rank_cannot_run"] = _one_rank_cannot_run(eng, td, rank)
        inf_z, tr_z, g_z = run(eng)
        r = {"head_is_own_unit": head is not eng.module and type(head).__name__.startswith("FSDP"),
             "micro_batches": len(eng.zorro_last_micro_batches),
             "max_rows_per_micro_batch": max(int(mask[mb].sum()) for mb in eng.zorro_last_micro_batches.batches),
             "fallback": inf_z["metrics"]["zorro/fallback_batches"] + tr_z["metrics"]["zorro/fallback_batches"]}
        for key in ("log_probs", "entropy"):
            d = response_values(inf_s["model_output"][key], td) - response_values(inf_z["model_output"][key], td)
            r[f"{key}_max_abs"] = d[mask].abs().max().item()
        r["loss"] = (sum(tr_s["loss"]), sum(tr_z["loss"]))
        r["grad_norm"] = (float(tr_s["metrics"]["grad_norm"]), float(tr_z["metrics"]["grad_norm"]))
        r["grad_rel"] = grad_rel_error(g_s, g_z)
        if consensus is not None:
            r["consensus_fallback"] = consensus["metrics"]["zorro/fallback_batches"]
            d = response_values(inf_s["model_output"]["log_probs"], td) - response_values(
                consensus["model_output"]["log_probs"], td)
            r["consensus_log_probs_max_abs"] = d[mask].abs().max().item()
        res[mode] = r
    dist.barrier()
    dist.destroy_process_group()
    return res


if __name__ == "__main__":
    from tests.support.multi_rank import rank_main

    rank_main(run_rank, str)
