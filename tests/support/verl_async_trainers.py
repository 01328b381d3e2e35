"""One rank of the experimental-trainer test (tests/integrations/verl/v09/test_async_trainers.py): verl 0.9.1's
``OneStepOffRayTrainer`` and ``FullyAsyncTrainer`` balance a recorded rollout batch through their own code path
(zorro on: zorro's hook; zorro off: verl's balancing), and the batch they dispatch is trained by the stock engine
(zorro-off placement) and by the zorro engine (zorro placement) over the optimizer steps verl's worker cuts from it.

Run as ``python -m tests.support.verl_async_trainers RANK WORLD INIT_FILE CKPT OUT_JSON`` (gloo, ``file://``
rendezvous, the CPU platform, fp32). Per trainer, on every rank:

1. the recorded batch (:func:`tests.support.verl_matrix.global_rows`: 2 x WORLD prompts x 4 rollouts behind a shared
   system prompt, siblings interleaved) is balanced by the trainer's own path — ``OneStepOffRayTrainer._balance_batch``
   on a trainer instance (what ``_async_gen_next_batch`` calls), and for ``FullyAsyncTrainer`` verl's
   ``assemble_batch_from_rollout_samples`` on one ``RolloutSample`` per prompt with the trainer's bound
   ``_balance_batch`` (what ``_get_samples_from_queue`` calls) — with the actor's zorro node enabled and disabled;
2. rank ``k`` takes the ``k``-th equal chunk (verl's dispatch) and cuts it into mini-batches with verl's own iterator
   (:func:`zorro_verl.integrations.verl.v09.balance.verl_minibatch_ids`; ``ppo_mini_batch_size`` = WORLD prompts,
   so two optimizer steps);
3. per mini-batch: the inference pass and a training step (SGD) of the stock engine on the zorro-off placement and of
   the zorro engine on the zorro placement. Rows sit on other ranks in the two runs, so per-row log-probs are
   gathered and matched by row id; the loss is summed over ranks; grad norm and the (all-reduced) gradients are
   compared directly.

Results (errors per step, row sets per optimizer step, dedup of each placement, balance metrics, stamps) go to
``OUT_JSON``.
"""

from __future__ import annotations

import os
import time

__all__ = ["run_rank", "trainer_order", "trainer_class", "TRAINERS"]

#: The experimental trainers under test: (module, class).
TRAINERS = {"one_step_off": ("verl.experimental.one_step_off_policy.ray_trainer", "OneStepOffRayTrainer"),
            "fully_async": ("verl.experimental.fully_async_policy.fully_async_trainer", "FullyAsyncTrainer")}
N = 4  # rollout.n


def trainer_class(name: str) -> type:
    """The trainer class ``name`` of :data:`TRAINERS` (``FullyAsyncTrainer`` is a Ray actor class,
    ``@ray.remote``: the class it wraps, which Ray's actor process instantiates through a subclass)."""
    import importlib

    module, cls_name = TRAINERS[name]
    cls = getattr(importlib.import_module(module), cls_name)
    return getattr(cls, "__ray_actor_class__", cls)


def _trainer(name: str, zorro: bool, dp: int, prompts_per_minibatch: int):
    """An instance of the real trainer class (``__init__`` would start Ray worker groups and rollout servers), with
    what its ``_balance_batch`` reads: the config, the actor worker group's dispatch info, the step."""
    import types

    from omegaconf import OmegaConf

    cls = trainer_class(name)
    t = cls.__new__(cls)
    t.config = OmegaConf.create({
        "trainer": {"critic_warmup": 0, "balance_batch": True},
        "actor_rollout_ref": {"rollout": {"n": N, "temperature": 1.0}, "actor": {
            "ppo_mini_batch_size": prompts_per_minibatch, "ppo_micro_batch_size_per_gpu": N, "ppo_epochs": 1,
            "shuffle": False, "data_loader_seed": 42,
            "fsdp_config": {"zorro": {"enable": zorro, "rollout_n": N}}}}})
    t.actor_rollout_wg = types.SimpleNamespace(_dispatch_info={"actor": list(range(dp))})
    t.use_critic = False
    t.global_steps = 1
    return t


def _data_proto(base: dict, rows: list):
    import numpy as np
    import torch
    from verl import DataProto

    idx = torch.tensor(rows)
    ids, am = base["input_ids"][idx], base["attention_mask"][idx]
    P = ids.shape[1] - base["responses"].shape[1]
    return DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": am, "prompts": ids[:, :P],
                                        "responses": base["responses"][idx], "row": idx.clone()},
                               non_tensors={"uid": np.array([str(base["uid"][i]) for i in rows], dtype=object)})


def trainer_order(name: str, base: dict, zorro: bool, dp: int, prompts_per_minibatch: int) -> tuple:
    """``(order, metrics, meta_info)``: the rows of ``base`` in the order the trainer ``name`` dispatches them, its
    balance metrics (fully async: verl passes ``metrics={}`` and drops them; reported empty) and the batch's meta
    data (zorro's balance stamp)."""
    import numpy as np

    t = _trainer(name, zorro, dp, prompts_per_minibatch)
    B = len(base["uid"])
    metrics: dict = {}
    if name == "one_step_off":
        batch = _data_proto(base, list(range(B)))
        batch.batch["response_mask"] = batch.batch["attention_mask"][:, -batch.batch["responses"].shape[1]:]
        t._balance_batch(batch, metrics=metrics)  # as OneStepOffRayTrainer._async_gen_next_batch
    else:
        from verl.experimental.fully_async_policy.detach_utils import RolloutSample, assemble_batch_from_rollout_samples

        samples = []
        prompts = sorted(set(base["uid"]), key=lambda u: (u * 3) % (B // N))  # completion order
        for u in prompts:
            rows = [i for i in range(B) if base["uid"][i] == u]
            full = _data_proto(base, rows)
            full.meta_info["metrics"] = [{"generate_sequences": 0.1, "tool_calls": 0.0}] * len(rows)
            full.non_tensor_batch["min_global_steps"] = np.zeros(len(rows), dtype=object)
            full.non_tensor_batch["max_global_steps"] = np.zeros(len(rows), dtype=object)
            samples.append(RolloutSample(full_batch=full, sample_id=f"s{u}", epoch=0, rollout_status={}))
        # as FullyAsyncTrainer._get_samples_from_queue with trainer.balance_batch=true
        batch = assemble_batch_from_rollout_samples(samples, None, t.config, t._balance_batch)
    return batch.batch["row"].tolist(), metrics, {k: v for k, v in batch.meta_info.items()
                                                  if isinstance(v, (bool, int, float, str))}


def _minibatches(order: list, rank: int, dp: int, prompts_per_minibatch: int) -> list:
    """Rank ``rank``'s rows (ids of ``base``) of each optimizer step, cut by verl's own iterator."""
    from zorro_verl.integrations.verl.v09.balance import verl_minibatch_ids

    B = len(order)
    ids = verl_minibatch_ids(B, dp, prompts_per_minibatch * N, 1, 42, False)
    per = B // dp
    steps = sorted({s for i in range(B) for s in ids[i]})
    return [[order[i] for i in range(rank * per, (rank + 1) * per) if ids[i] == (s,)] for s in steps]


def _row_logprobs(out, td, rows: list) -> dict:
    from tests.support.verl_engines import response_values

    lp = response_values(out["model_output"]["log_probs"], td)
    mask = td["response_mask"].bool()
    return {int(r): lp[b][mask[b]].tolist() for b, r in enumerate(rows)}


def run_rank(rank: int, world: int, init_file: str, ckpt: str) -> dict:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      VERL_ENGINE_DEVICE="cpu", OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from tests.support.verl_cpu_platform import use_cpu_platform

    use_cpu_platform()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    import verl.workers.engine  # noqa: F401  (registers the zorro engine)

    from tests.support.verl_engines import STEPS_OPTIM, build_engine, make_engine_batch, run_steps
    from tests.support.verl_matrix import _chunk, global_rows
    from zorro_verl.testing import grad_rel_error

    t0 = time.perf_counter()
    dp, ppm = world, world  # every rank a DP rank; WORLD prompts per mini-batch: two optimizer steps
    engines = {z: build_engine(ckpt, zorro=z, strategy="fsdp2", micro_batch_size=N, optim_overrides=STEPS_OPTIM,
                               zorro_settings={"rollout_n": N} if z else None) for z in (False, True)}
    out = {"rank": rank, "trainers": {}}
    for name in TRAINERS:
        base = global_rows("dense", 0 if name == "one_step_off" else 1, dp)
        res = {"orders": {}, "metrics": {}, "meta": {}, "steps": [], "dedup": {}}
        runs = {}
        for z in (False, True):
            order, metrics, meta = trainer_order(name, base, z, dp, ppm)
            res["orders"][str(z)], res["metrics"][str(z)], res["meta"][str(z)] = order, metrics, meta
            rows = _minibatches(order, rank, dp, ppm)
            tds = []
            for r in rows:
                td = make_engine_batch(base={k: v for k, v in _chunk(base, r).items() if k != "uid"}, temperature=0.8,
                                       calculate_entropy=True, micro_batch_size=N, global_batch_size=ppm * N)
                from verl.utils import tensordict_utils as tu

                tu.assign_non_tensor(td, **{k: v for k, v in meta.items() if k.startswith("zorro")})
                tds.append(td)
            # the deduplication each placement allows on this rank (zorro's packing of the rows; no collective)
            mbs = [engines[True]._zorro_local_micro_batches(td)[0] for td in tds]
            res["dedup"][str(z)] = sum(m.ordinary_tokens for m in mbs) / sum(m.dedup_tokens for m in mbs)
            runs[z] = (rows, tds, run_steps(engines[z], tds))
        for k in range(len(runs[False][0])):
            (ra, ta, sa), (rb, tb, sb) = ((runs[z][0][k], runs[z][1][k], runs[z][2][k]) for z in (False, True))
            lps = [None] * world
            dist.all_gather_object(lps, (_row_logprobs(sa["inf"], ta, ra), _row_logprobs(sb["inf"], tb, rb)))
            a = {r: v for x, _ in lps for r, v in x.items()}
            b = {r: v for _, y in lps for r, v in y.items()}
            loss = torch.tensor([sum(sa["tr"]["loss"]), sum(sb["tr"]["loss"])], dtype=torch.float64)
            dist.all_reduce(loss)
            lp_err = max((abs(x - y) for r in a for x, y in zip(a[r], b[r])), default=float("inf"))
            res["steps"].append({
                "rows_stock": sorted(a), "rows_zorro": sorted(b),
                "lengths_match": all(len(a[r]) == len(b.get(r, ())) for r in a),
                "log_probs": lp_err, "log_probs_scale": max(abs(x) for v in a.values() for x in v),
                "loss": loss.tolist(),
                "grad_norm": [float(sa["tr"]["metrics"]["grad_norm"]), float(sb["tr"]["metrics"]["grad_norm"])],
                "grad_rel": grad_rel_error(sa["grads"], sb["grads"]),
                "fallback": [m.get("zorro/fallback_batches", [0.0])[0] for m in (sb["inf"]["metrics"],
                                                                              sb["tr"]["metrics"])],
                "hooks_missing": sb["inf"]["metrics"].get("zorro/balance_hooks_missing", [None])[0],
                "dedup_ratio": sb["inf"]["metrics"]["zorro/dedup_ratio"][0]})
        out["trainers"][name] = res
        dist.barrier()
    out["seconds"] = time.perf_counter() - t0
    dist.destroy_process_group()
    return out


if __name__ == "__main__":
    from tests.support.multi_rank import rank_main

    rank_main(run_rank, str)
