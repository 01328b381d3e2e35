"""One rank of the Megatron engine's pairwise configuration matrix (tests/integrations/megatron/test_matrix.py):
every case of :mod:`tests.support.megatron_matrix` whose world is this group's, one after the other in the same
processes (megatron's groups rebuilt per case). Per case: verl 0.9.1's stock engine (padded bshd path, megatron's
own attention, non-fused head: no project code) and zorro's engine built alike from the same checkpoint, then on the
same GRPO batch (each DP rank its equal share of the 12 rows) ``infer_batch`` log-probs / entropy and two
``train_batch`` SGD steps: loss and grad norm, every trainable parameter's gradient of every model chunk (each rank
its shards / stage) and the parameters after each step. A case that raises records the message (a refusal is
expected by name by the test, anything else fails it).

Run as ``python -m tests.support.megatron_matrix_ranks RANK WORLD INIT_FILE CKPT_DIR OUT_JSON``.
"""

from __future__ import annotations

import gc
import os
import time
import traceback
from functools import partial

from tests.support.megatron_matrix import case_name, cases_of_world, dp_of
from tests.support.multi_rank import first_metric, rank_main

ZORRO = {"enable": True, "rollout_n": 4, "attention_backend": "sdpa"}
#: verl's Megatron LoRA on every linear layer, B initialised like A (the adapters act from the first step on), as
#: tests/support/megatron_engine_ranks.py
LORA = {"type": "lora", "rank": 4, "alpha": 16, "dropout": 0.0, "lora_B_init_method": "xavier",
        "target_modules": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]}
#: megatron's fused MoE paths need Transformer Engine (the bridges turn them on); the local spec's SequentialMLP
MOE_CPU = {"moe_permute_fusion": False, "moe_grouped_gemm": False, "moe_router_fusion": False}
#: (family, layers) of each model option: 4 layers under virtual pipeline stages (one per model chunk)
FAMILY = {"dense": "qwen3", "moe_ep1": "qwen3_moe", "moe_ep2": "qwen3_moe"}


def checkpoint_path(ckpt: str, model: str, layers: int) -> str:
    return f"{ckpt}_{FAMILY[model]}_{layers}"


def _save_all(ckpt: str) -> None:
    """Rank 0 writes the four tiny checkpoints (dense / MoE, 2 / 4 layers) once; ``ckpt`` itself marks it done."""
    from tests.support import megatron_engines as E

    for family in ("qwen3", "qwen3_moe"):
        for layers in (2, 4):
            E.save_tiny_checkpoint(f"{ckpt}_{family}_{layers}", family, layers=layers)
    E.save_tiny_checkpoint(ckpt)


def _params(engine, trainable_only: bool = False) -> dict:
    """Every parameter of every model chunk of this stage, by ``chunk<i>.<name>``."""
    from verl.utils.megatron_utils import unwrap_model

    return {f"chunk{i}.{n}": p for i, c in enumerate(engine.module) for n, p in unwrap_model(c).named_parameters()
            if p.requires_grad or not trainable_only}


def _grads(engine) -> dict:
    out = {}
    for name, p in _params(engine, trainable_only=True).items():
        g = getattr(p, "main_grad", None)
        g = p.grad if g is None else g
        assert g is not None, f"{name}: no gradient"
        out[name] = g.detach().clone()
    return out


def _built(engine) -> dict:
    """What the engine was really built as (the test checks it against the case)."""
    from megatron.core import parallel_state as mpu
    from verl.utils.megatron_utils import unwrap_model

    gpt = unwrap_model(engine.module[0])
    routers = [m for m in gpt.modules() if type(m).__name__ == "TopKRouter"]
    return {"vanilla": bool(engine.vanilla_bridge), "tp": mpu.get_tensor_model_parallel_world_size(),
            "pp": mpu.get_pipeline_model_parallel_world_size(), "dp": mpu.get_data_parallel_world_size(),
            "chunks": len(engine.module), "sp": bool(engine.tf_config.sequence_parallel),
            "ep": mpu.get_expert_model_parallel_world_size(), "routers": len(routers),
            "lora_trainable": sum(1 for n in _params(engine, trainable_only=True) if "adapter" in n),
            "trainable": len(_params(engine, trainable_only=True)), "params": len(_params(engine)),
            "fused": bool(engine.engine_config.use_fused_kernels),
            "zorro_reason": getattr(engine, "_zorro_static_reason", None)}


def _compare(E, stock, zorro, td_of) -> dict:
    """``infer_batch`` then two ``train_batch`` steps on both engines (``td_of(name)`` builds each one's batch)."""
    from megatron.core import parallel_state as mpu

    out = {}
    last = mpu.is_pipeline_last_stage(ignore_virtual=True)
    res = {}
    for name, eng in (("stock", stock), ("zorro", zorro)):
        with eng.eval_mode():
            res[name] = eng.infer_batch(td_of(name), loss_function=None)
    if last:
        td = td_of("stock")
        for key in ("log_probs", "entropy"):
            s = E.response_values(res["stock"]["model_output"][key], td)
            z = E.response_values(res["zorro"]["model_output"][key], td)
            out[key] = (z - s).abs().max().item()
        out["n_tokens"] = int(s.numel())
        m = res["zorro"].get("metrics", {})
        out["dedup_ratio"] = first_metric(m.get("zorro/dedup_ratio"))
        out["fallback"] = first_metric(m.get("zorro/fallback_batches"))
    ps, pz = _params(stock), _params(zorro)
    assert ps.keys() == pz.keys()
    out["init_params"] = max((pz[k] - ps[k]).abs().max().item() for k in ps)
    for step in (1, 2):
        train = {}
        for name, eng in (("stock", stock), ("zorro", zorro)):
            with eng.train_mode(zero_grad_on_exit=False):
                train[name] = eng.train_batch(td_of(name), loss_function=E.ppo_loss_fn())
        gs, gz = _grads(stock), _grads(zorro)
        assert gs.keys() == gz.keys() and gs
        rel = {k: ((gz[k] - gs[k]).abs().max() / gs[k].abs().max().clamp_min(1e-30)).item() for k in gs}
        out[f"step{step}/grad_rel"] = max(rel.values())
        out[f"step{step}/grad_rel_worst"] = max(rel, key=rel.get)
        out[f"step{step}/params"] = max((pz[k] - ps[k]).abs().max().item() for k in ps)
        if last:
            ls, lz = sum(train["stock"]["loss"]), sum(train["zorro"]["loss"])
            out[f"step{step}/loss_rel"] = abs(lz - ls) / abs(ls)
            out[f"step{step}/train_fallback"] = first_metric(train["zorro"]["metrics"].get("zorro/fallback_batches"))
        if "grad_norm" in train["stock"].get("metrics", {}):
            gn_s = first_metric(train["stock"]["metrics"]["grad_norm"])
            gn_z = first_metric(train["zorro"]["metrics"]["grad_norm"])
            out[f"step{step}/grad_norm_rel"] = abs(gn_z - gn_s) / gn_s
    out["n_grads"] = len(gs)
    out["grad_chunks"] = sorted({k.split(".")[0] for k in gs})
    out["n_micro_batches"] = len(zorro.zorro_last_micro_batches.batches)
    return out


def _batch(E, case: dict, rows: slice, micro_batch: int, fused: bool):
    from verl.utils import tensordict_utils as tu

    td = E.make_batch(dynamic=case["dynamic"], rows=rows, micro_batch=micro_batch,
                      shared_prefix=case["sharing"] == "prefix")
    if fused:  # what verl's actor sets from actor.use_fused_kernels
        tu.assign_non_tensor(td, use_fused_kernels=True)
    return td


def run_case(E, case: dict, ckpt: str) -> dict:
    """Build both engines for ``case`` and compare them (see the module docstring)."""
    from megatron.core import parallel_state as mpu

    path = checkpoint_path(ckpt, case["model"], 4 if case["vpp"] else 2)
    engine_kwargs = {"sequence_parallel": case["sp"]}
    if case["vpp"]:
        engine_kwargs["virtual_pipeline_model_parallel_size"] = 2
    if case["model"] == "moe_ep2":  # verl's default expert TP (= TP): the experts split over the DP group
        engine_kwargs["expert_model_parallel_size"] = 2
    kw = dict(tp=case["tp"], pp=case["pp"], model_kwargs={"lora": LORA} if case["lora"] else {},
              transformer_overrides=MOE_CPU if case["model"] != "dense" else {})
    zcfg = {**ZORRO, "sharing": case["sharing"], **({"min_shared_len": 1} if case["sharing"] == "prefix" else {})}
    build = partial(E.build_engine, bridge=case["builder"])
    stock = build(path, zorro=None, remove_padding=False, engine_kwargs=engine_kwargs, **kw)
    zorro = build(path, zorro=zcfg, engine_kwargs={**engine_kwargs, "use_fused_kernels": case["fused"]}, **kw)
    assert type(zorro).__name__ == "ZorroMegatronEngineWithLMHead", type(zorro)
    dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    assert dp == dp_of(case), (dp, case)
    per = 12 // dp
    rows = slice(dp_rank * per, (dp_rank + 1) * per)
    # an even micro-batch count per rank (megatron's interleaved schedule runs groups of 2): 6 of 2 rows, 2 of 3
    micro_batch = 2 if per == 12 else 3
    out = {"built": {"stock": _built(stock), "zorro": _built(zorro)}}
    out.update(_compare(E, stock, zorro,
                        lambda name: _batch(E, case, rows, micro_batch, fused=case["fused"] and name == "zorro")))
    return out


def run_rank(rank: int, world: int, init_file: str, ckpt: str) -> dict:
    import torch.distributed as dist

    from tests.support import megatron_bridge_cpu
    from tests.support import megatron_engines as E
    from tests.support.megatron_moe import alltoall_cpu_shims

    E.start_rank(rank, world, init_file, ckpt, save=_save_all)
    alltoall_cpu_shims()  # M1 (EP = 2 over gloo)
    out = {}
    only = os.environ.get("ZORRO_MATRIX_CASES")  # debugging: a comma-separated subset of case names
    for case in cases_of_world(world):
        name = case_name(case)
        if only and name not in only.split(","):
            continue
        if case["builder"] not in megatron_bridge_cpu.installed_bridges():
            out[name] = {"skipped": f"{case['builder']} is not installed here", "seconds": 0.0}
            continue
        t0 = time.time()
        try:
            out[name] = run_case(E, case, ckpt)
        except Exception as e:  # recorded: the test expects refusals by name and fails on anything else
            out[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        out[name]["seconds"] = time.time() - t0
        print(f"rank {rank}: {name} {out[name].get('error', 'ok')} ({out[name]['seconds']:.0f} s)", flush=True)
        gc.collect()
        dist.barrier()
    return out


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rank_main(run_rank, str)
