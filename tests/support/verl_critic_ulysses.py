"""One rank of the critic's Ulysses check (tests/integrations/verl/v09/test_value_engine.py): gloo with a
``file://`` rendezvous, the CPU platform, fp32 FSDP over both ranks; under FSDP2 and FSDP1 in the same processes.

Run as ``python -m tests.support.verl_critic_ulysses RANK WORLD INIT_FILE CKPT SP OUT_JSON`` (``WORLD == SP``: one SP
group, both ranks hold the same batch). Two critics run two steps each (:func:`~tests.support.verl_engines.run_steps`:
``compute_values``, then ``update_critic`` with verl's ``value_loss`` and one SGD step):

* ``stock``: verl's stock ``FSDPEngineWithValueHead`` without SP (``sdpa``; both ranks are DP ranks holding the same
  batch, so it computes the same global step);
* ``zorro_sp``: the zorro value engine with ``ulysses_sequence_parallel_size = SP``.

The per-step errors (:func:`~tests.support.verl_engines.value_step_errors`) go to ``OUT_JSON``, keyed by strategy.
"""

from __future__ import annotations

import os

__all__ = ["run_rank"]


def run_rank(rank: int, world: int, init_file: str, ckpt: str, sp: int) -> dict:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      VERL_ENGINE_DEVICE="cpu", OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from tests.support.verl_cpu_platform import use_cpu_platform

    use_cpu_platform()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)

    import verl.workers.engine  # noqa: F401  (registers the zorro engines before their modules are imported here)

    from tests.support.verl_engines import (
        STEPS_OPTIM,
        STRATEGIES,
        build_engine,
        make_value_batch,
        run_steps,
        value_loss_fn,
        value_step_errors,
    )

    assert world == sp, "one SP group: both ranks hold the same batch"
    mbs = 3
    # the same rows on every rank (an SP group holds one batch); 3 shuffled prompts, fixed micro-batches of 3 rows
    batches = [make_value_batch(batch_size=12, num_prompts=3, prompt_len=7, response_len=6, seed=seed,
                                micro_batch_size=mbs, global_batch_size=12) for seed in (3, 4)]
    out = {"rank": rank}
    for strategy in STRATEGIES:
        runs = {}
        for name, kw in (("stock", {"zorro": False}),
                         ("zorro_sp", {"zorro": True, "engine_overrides": {"ulysses_sequence_parallel_size": sp}})):
            eng = build_engine(ckpt, model_type="value_model", strategy=strategy, micro_batch_size=mbs,
                               optim_overrides=STEPS_OPTIM, **kw)
            runs[name] = run_steps(eng, batches, value_loss_fn())
        errs = value_step_errors(runs["stock"], runs["zorro_sp"], batches)
        dedup = runs["zorro_sp"][0]["inf"]["metrics"]["zorro/dedup_ratio"][0]
        out[strategy] = {"errors": errs, "dedup_ratio": dedup}
    dist.barrier()
    dist.destroy_process_group()
    return out


if __name__ == "__main__":
    from tests.support.multi_rank import rank_main

    rank_main(run_rank, str, int)
