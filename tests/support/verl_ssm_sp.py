"""One rank of the Mamba-2 Ulysses engine check (tests/integrations/verl/v09/test_ssm_engine.py): gloo with a
``file://`` rendezvous, the CPU platform, fp32 FSDP2 over 2 ranks.

Run as ``python -m tests.support.verl_ssm_sp RANK WORLD INIT_FILE CKPT OUT_JSON``. Both ranks hold the same batch
(8 rows of 2 shuffled prompts, micro-batches of 4). The zorro engine runs it with ``ulysses_sequence_parallel_size =
WORLD`` (one SP group); the reference is verl's stock engine without SP, run padded (``use_remove_padding=False``:
transformers' CPU Mamba-2 path cannot separate packed rows; both ranks are then DP ranks with the same batch, so it
computes the same global step). Inference (log-probs, entropy) and one training step (loss, grad norm, every
gradient); the results go to ``OUT_JSON``.
"""

from __future__ import annotations

import os

__all__ = ["run_rank"]


def run_rank(rank: int, world: int, init_file: str, ckpt: str) -> dict:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      VERL_ENGINE_DEVICE="cpu", OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from tests.support.verl_cpu_platform import use_cpu_platform

    use_cpu_platform()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    import verl.workers.engine  # noqa: F401  (registers the zorro engine before its module is imported here)

    from tests.support.verl_engines import build_engine, engine_grads, make_engine_batch, ppo_loss_fn, response_values
    from zorro_verl.testing import grad_rel_error

    batches = [make_engine_batch(batch_size=8, num_prompts=2, prompt_len=9, response_len=5, seed=5, shuffle=True,
                                 temperature=0.8, calculate_entropy=True, micro_batch_size=4, use_remove_padding=z)
               for z in (False, True)]
    mask = batches[1]["response_mask"].bool()
    inf, tr, grads = [], [], []
    for z, td in zip((False, True), batches):
        eng = build_engine(ckpt, zorro=z, micro_batch_size=4, use_remove_padding=z, strategy="fsdp2",
                           engine_overrides={"ulysses_sequence_parallel_size": world} if z else None)
        with eng.eval_mode():
            inf.append(eng.infer_batch(td.clone(), loss_function=None))
        with eng.train_mode(zero_grad_on_exit=False):  # keep the grads for the comparison
            tr.append(eng.train_batch(td.clone(), loss_function=ppo_loss_fn()))
        grads.append(engine_grads(eng))
    res = {"rank": rank}
    for key in ("log_probs", "entropy"):
        a, b = (response_values(o["model_output"][key], t) for o, t in zip(inf, batches))
        res[f"{key}_max_abs"] = (a - b)[mask].abs().max().item()
        res[f"{key}_scale"] = a[mask].abs().max().item()
    res["loss"] = [float(sum(x["loss"])) for x in tr]
    norms = [x["metrics"].get("grad_norm") for x in tr]
    res["grad_norm"] = None if None in norms else [float(n) for n in norms]
    res["grad_rel"] = grad_rel_error(grads[0], grads[1])
    res["fallback"] = tr[1]["metrics"].get("zorro/fallback_batches")
    dist.barrier()
    dist.destroy_process_group()
    return res


if __name__ == "__main__":
    from tests.support.multi_rank import rank_main

    rank_main(run_rank, str)
