"""One rank of the 2-process verl 0.9 engine check (tests/integrations/verl/v09/test_two_ranks.py): gloo with a
``file://`` rendezvous, the CPU platform, FSDP2 and FSDP1 (verl's ``strategy: fsdp``) in the same two processes.

Run as ``python -m tests.support.verl_two_ranks RANK WORLD INIT_FILE CKPT OUT_JSON``. Under each strategy each rank
runs, on its own shards (rank 0: 8 rows of 2 prompts, rank 1: 12 rows of 3 prompts; dynamic batch size, which stock
verl equalises across ranks), two steps — the inference pass (log-probs, entropy) and a training step (loss, grad
norm, every gradient; SGD, :data:`~tests.support.verl_engines.STEPS_OPTIM`) — of the stock engine and of the zorro
engine in logits modes ``memory`` and ``compute`` (``logits_chunk_size = 4``), and compares them step by step. In
``memory`` the untied ``lm_head`` is its own FSDP unit (FSDP2: verl wraps it so; FSDP1: a size-based wrap policy,
:func:`~tests.support.verl_engines.head_unit_policy`); ``compute`` runs FSDP1 with verl's default policy (the head in
the root unit, sharded with it). A batch unsupported on rank 0 only must make *both* ranks run the stock forward
(``on_unsupported = warn``). Last (verl patches the model class's forward for the whole process), verl's fused kernels:
the zorro fused engine against the stock engine's steps, and under FSDP1 also against verl's own fused engine (under
FSDP2 that one fails on the untied head, see test_fused.py) and with the head as its own FSDP1 unit. Results go to
``OUT_JSON``. Before them, under each strategy, LoRA (a saved adapter both engines load): zorro vs stock over the same
two steps.
Under FSDP2 (first strategy) the memory-mode engine also checks that a batch only one rank cannot run (position ids
off verl's layout, a token budget a row does not fit, more micro-batches than the other rank has rows) makes both
ranks raise, or both run stock (:func:`_one_rank_cannot_run`).
"""

from __future__ import annotations

import os

__all__ = ["run_rank"]

#: verl's fused kernels, torch backend (the model config's flag; verl's worker copies it into the engine config).
FUSED_MODEL = {"use_fused_kernels": True, "fused_kernel_options": {"impl_backend": "torch"}}


def _rank_batches(rank: int, fused: bool = False) -> list:
    """This rank's batch of each step."""
    from verl.utils import tensordict_utils as tu

    from tests.support.verl_engines import make_engine_batch

    out = []
    for step in range(2):
        if rank == 0:
            td = make_engine_batch(batch_size=8, num_prompts=2, prompt_len=7, response_len=6, seed=31 + 10 * step,
                                   shuffle=True, temperature=0.8, use_dynamic_bsz=True, max_token_len=40,
                                   global_batch_size=20)
        else:
            td = make_engine_batch(batch_size=12, num_prompts=3, prompt_len=6, response_len=7, seed=32 + 10 * step,
                                   shuffle=True, temperature=0.8, use_dynamic_bsz=True, max_token_len=40,
                                   global_batch_size=20)
        tu.assign_non_tensor(td, use_fused_kernels=fused)
        out.append(td)
    return out


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
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from verl.utils import tensordict_utils as tu

    from tests.support.verl_engines import (
        STEPS_OPTIM,
        STRATEGIES,
        build_engine,
        head_unit_policy,
        lora_adapter,
        lora_model,
        response_values,
        run_steps,
        step_errors,
    )

    batches = _rank_batches(rank)
    common = dict(use_dynamic_bsz=True, max_token_len=40, optim_overrides=STEPS_OPTIM)
    res = {"rank": rank, "rows": [int(td["response_mask"].shape[0]) for td in batches]}
    stock_runs = {}
    for strategy in STRATEGIES:
        stock_runs[strategy] = run_steps(build_engine(ckpt, zorro=False, strategy=strategy, **common), batches)
        res[strategy] = {}
        for mode in ("memory", "compute"):
            unit = head_unit_policy(ckpt) if strategy == "fsdp" and mode == "memory" else None
            eng = build_engine(ckpt, zorro=True, strategy=strategy, engine_overrides=unit,
                               zorro_settings={"logits_optimization": mode, "on_unsupported": "warn"}, **common)
            eng.logits_chunk_size = 4
            head = eng.module.get_output_embeddings()
            units = (FSDPModule, FullyShardedDataParallel)
            r = {"head_is_own_unit": head is not eng.module and isinstance(head, units)}
            if mode == "memory":
                # a batch only rank 0 cannot run with zorro: both ranks must take the stock path (no hang)
                bad = batches[0].clone()
                if rank == 0:
                    tu.assign_non_tensor(bad, calculate_sum_pi_squared=True)
                with eng.eval_mode():
                    consensus = eng.infer_batch(bad, loss_function=None)
                r["consensus_fallback"] = consensus["metrics"]["zorro/fallback_batches"]
                mask = batches[0]["response_mask"].bool()
                d = (response_values(stock_runs[strategy][0]["inf"]["model_output"]["log_probs"], batches[0])
                     - response_values(consensus["model_output"]["log_probs"], batches[0]))
                r["consensus_log_probs_max_abs"] = d[mask].abs().max().item()
                if strategy == STRATEGIES[0]:
                    res["one_rank_cannot_run"] = _one_rank_cannot_run(eng, batches[0].clone(), rank)
            runs = run_steps(eng, batches)
            last = batches[-1]["response_mask"].bool()
            r.update(micro_batches=len(eng.zorro_last_micro_batches),
                     max_rows_per_micro_batch=max(int(last[mb].sum()) for mb in eng.zorro_last_micro_batches.batches),
                     steps=step_errors(stock_runs[strategy], runs, batches))
            res[strategy][mode] = r
        # LoRA: both engines load the same saved adapter (lora_B random, so lora_A has gradients), logits modes none
        # and memory (the head in the root unit under FSDP1: verl's LoRA wrap policy takes no size-based policy)
        lora = {**common, "model_overrides": lora_model(lora_adapter(
            ckpt, os.path.join(os.path.dirname(init_file), f"lora_{strategy}_{rank}"), seed=3))}
        stock_lora = run_steps(build_engine(ckpt, zorro=False, strategy=strategy, **lora), batches)
        res[strategy]["lora"] = {}
        for mode in ("none", "memory"):
            eng = build_engine(ckpt, zorro=True, strategy=strategy, zorro_settings={"logits_optimization": mode},
                               **lora)
            eng.logits_chunk_size = 4
            zorro_lora = run_steps(eng, batches)
            res[strategy]["lora"][mode] = {"steps": step_errors(stock_lora, zorro_lora, batches),
                                           "grad_names": sorted(zorro_lora[0]["grads"])}
    # verl's fused kernels: it patches the model class's forward when it builds such an engine, for the process
    fused_batches = _rank_batches(rank, fused=True)
    fused = dict(model_overrides=FUSED_MODEL, engine_overrides={"use_fused_kernels": True}, **common)
    for strategy in STRATEGIES:
        runs = run_steps(build_engine(ckpt, zorro=True, strategy=strategy, **fused), fused_batches)
        r = {"steps": step_errors(stock_runs[strategy], runs, batches)}
        if strategy == "fsdp":
            # verl's own fused path works under FSDP1 with its default wrap policy (the head is in the root unit)
            stock_fused = run_steps(build_engine(ckpt, zorro=False, strategy=strategy, **fused), fused_batches)
            r["steps_vs_stock_fused"] = step_errors(stock_fused, runs, batches)
            # the head as its own FSDP1 unit: zorro's fused head runs inside the head's wrapper (verl's own fused
            # forward reads the head's weight outside it and fails there, as under FSDP2)
            unit = {**fused, "engine_overrides": {**head_unit_policy(ckpt), "use_fused_kernels": True}}
            head_unit = run_steps(build_engine(ckpt, zorro=True, strategy=strategy, **unit), fused_batches)
            r["steps_head_unit"] = step_errors(stock_runs[strategy], head_unit, batches)
        res[strategy]["fused"] = r
    dist.barrier()
    dist.destroy_process_group()
    return res


if __name__ == "__main__":
    from tests.support.multi_rank import rank_main

    rank_main(run_rank, str)
