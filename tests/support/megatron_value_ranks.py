"""One rank of the zorro-vs-stock Megatron *critic* check (tests/integrations/megatron/test_value_engine.py): verl
0.9.1's stock ``MegatronEngineWithValueHead`` (padded bshd path, megatron's own attention) and zorro's
``ZorroMegatronEngineWithValueHead``, fp32 on the CPU, built by Megatron-Bridge (verl's default) from the same tiny
Qwen3 checkpoint, the value head (verl's ``LinearForLastLayer``, freshly drawn) copied from the stock engine to
zorro's; then, in the same processes, zorro's value step on an fp64 model against megatron's ordinary forward under
TP = 2 + sequence parallelism.

Run as ``python -m tests.support.megatron_value_ranks RANK WORLD INIT_FILE CKPT_DIR OUT_JSON``. Layouts (2 ranks):
``tp1`` (TP = 1: DP = 2, rank 0 the first 8 rows, rank 1 the last 4; dynamic token budget) and ``tp2_sp`` (TP = 2 +
sequence parallel; fixed micro-batch size). Per layout two steps as the trainer runs them: ``infer_batch`` (verl's
``compute_values``), then ``train_batch`` with verl's ``value_loss`` (``update_critic``: one SGD step), each on a new
batch; per step the values at the positions verl reads, the value loss, the grad norm, every parameter's gradient
(each rank its shards) and the parameters after the step, plus zorro's metrics.
"""

from __future__ import annotations

import os
import time
from functools import partial

import torch

from tests.support.multi_rank import first_metric, rank_main

ZORRO = {"enable": True, "rollout_n": 4, "attention_backend": "sdpa"}
#: layout -> (TP size, dynamic micro-batches)
LAYOUTS = {"tp1": (1, True), "tp2_sp": (2, False)}
#: the dynamic token budget (per micro-batch; zorro counts each prompt once): small enough for several micro-batches
MAX_TOKENS = 24


def make_value_batch(E, *, seed: int, rows: slice | None, dynamic: bool):
    """:func:`tests.support.megatron_engines.make_batch` (3 prompts x 4 rollouts, interleaved) with the critic's
    training fields as verl's trainer hands them over: ``values`` (old values) and ``returns``, ``[B, R]`` fp32,
    zeros on response pads, drawn for all 12 rows and sliced like the batch."""
    td = E.make_batch(dynamic=dynamic, seed=seed, rows=rows, max_tokens=MAX_TOKENS)
    g = torch.Generator().manual_seed(seed + 1000)
    m = td["response_mask"].float()
    sel = slice(None) if rows is None else rows
    values = torch.randn(12, m.shape[1], generator=g)[sel]
    returns = torch.randn(12, m.shape[1], generator=g)[sel] + 0.5
    td["values"] = values * m
    td["returns"] = returns * m
    return td


def _steps(E, stock, zorro, batch_of, rank: int) -> dict:
    """Two (compute_values, update_critic) steps on both engines; per step the differences (plain floats)."""
    from megatron.core import parallel_state as mpu

    from tests.support.verl_engines import value_loss_fn

    last = mpu.is_pipeline_last_stage(ignore_virtual=True)
    out = {}
    for step in (1, 2):
        r = {}
        inf = {}
        for name, eng in (("stock", stock), ("zorro", zorro)):
            with eng.eval_mode():
                inf[name] = eng.infer_batch(batch_of(seed=step), loss_function=None)
        td = batch_of(seed=step)
        if last:
            s = E.response_values(inf["stock"]["model_output"]["values"], td)
            z = E.response_values(inf["zorro"]["model_output"]["values"], td)
            r["values"] = (z - s).abs().max().item()
            r["values_scale"] = s.abs().max().item()
            r["n_values"] = int(s.numel())
            m = inf["zorro"].get("metrics", {})
            r["infer_dedup_ratio"] = first_metric(m.get("zorro/dedup_ratio"))
            r["infer_fallback"] = first_metric(m.get("zorro/fallback_batches"))
        tr = {}
        for name, eng in (("stock", stock), ("zorro", zorro)):
            with eng.train_mode(zero_grad_on_exit=False):
                tr[name] = eng.train_batch(batch_of(seed=step), loss_function=value_loss_fn())
        gs, gz = E.grads(stock), E.grads(zorro)
        rel = {k: ((gz[k] - gs[k]).abs().max() / gs[k].abs().max().clamp_min(1e-30)).item() for k in gs}
        r["grad_rel"] = max(rel.values())
        r["grad_rel_worst"] = max(rel, key=rel.get)
        r["n_params"] = len(gs)
        r["head_grad"] = max(g.abs().max().item() for k, g in gs.items() if "output_layer" in k) \
            if any("output_layer" in k for k in gs) else None
        ps, pz = dict(E.gpt_of(stock).named_parameters()), dict(E.gpt_of(zorro).named_parameters())
        r["param_after_step"] = max((pz[k] - ps[k]).abs().max().item() for k in ps)
        r["n_micro_batches"] = len(zorro.zorro_last_micro_batches.batches)
        if last:
            ls, lz = sum(tr["stock"]["loss"]), sum(tr["zorro"]["loss"])
            r["loss"] = ls
            r["loss_rel"] = abs(lz - ls) / abs(ls)
            mz = tr["zorro"]["metrics"]
            r["train_dedup_ratio"] = first_metric(mz.get("zorro/dedup_ratio"))
            r["train_fallback"] = first_metric(mz.get("zorro/fallback_batches"))
            r["zorro_metrics"] = sorted(k for k in mz if k.startswith("zorro/"))
            # verl's value loss metrics beside zorro's
            r["stock_metrics"] = sorted(k for k in tr["stock"]["metrics"] if not k.startswith("zorro/"))
            r["zorro_stock_metrics"] = sorted(k for k in mz if not k.startswith("zorro/"))
        if "grad_norm" in tr["stock"].get("metrics", {}):  # the model-parallel source rank's outputs
            gn_s = first_metric(tr["stock"]["metrics"]["grad_norm"])
            gn_z = first_metric(tr["zorro"]["metrics"]["grad_norm"])
            r["grad_norm"] = gn_s
            r["grad_norm_rel"] = abs(gn_z - gn_s) / gn_s
        out[f"step{step}"] = r
    return out


def _engines(E, ckpt: str, tp: int) -> tuple:
    """verl's own ``MegatronEngineWithValueHead`` and zorro's critic; zorro's value head set to the stock one's
    (each engine draws its own)."""
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithValueHead

    kw = dict(tp=tp, model_type="value_model", max_tokens=MAX_TOKENS)
    stock = E.build_engine(ckpt, zorro=None, remove_padding=False, engine_cls=MegatronEngineWithValueHead, **kw)
    zorro = E.build_engine(ckpt, zorro=ZORRO, **kw)
    head_s, head_z = E.gpt_of(stock).output_layer, E.gpt_of(zorro).output_layer
    with torch.no_grad():
        head_z.weight.copy_(head_s.weight)
    ps, pz = dict(E.gpt_of(stock).named_parameters()), dict(E.gpt_of(zorro).named_parameters())
    built = {"stock": type(stock).__name__, "zorro": type(zorro).__name__, "head": type(head_z).__name__,
             "head_shape": list(head_z.weight.shape), "vanilla": bool(zorro.vanilla_bridge),
             "provider": type(zorro.provider).__name__ if zorro.provider is not None else None,
             "init_params": max((pz[k] - ps[k]).abs().max().item() for k in ps), "same_keys": ps.keys() == pz.keys()}
    return stock, zorro, built


def _fp64_tp2_sp(rank: int, world: int, init_file: str) -> dict:
    """zorro's value step vs megatron's ordinary forward, fp64, TP = 2 + sequence parallel, prompt and prefix plans."""
    import torch.distributed as dist

    from tests.support import megatron_cpu as M
    from tests.support import megatron_value as V

    # megatron's LanguageModule records the engines' attention backend in NVTE_* variables and asserts them at the
    # next build (the local spec's model here: auto)
    for var in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
        os.environ.pop(var, None)
    M.init_megatron(rank, world, init_file, tensor=world)
    out = {}
    for sharing in ("prompt", "prefix"):
        stock = V.value_gpt(zorro=False, sequence_parallel=True)
        zorro = V.value_gpt(zorro=True, sequence_parallel=True)
        zorro.load_state_dict(stock.state_dict())
        ids, am, R = M.make_batch(shared_prefix=sharing == "prefix")
        s = V.stock_values(stock, ids, am, R, tp_multiple=world)
        z, plan = V.zorro_values_of(zorro, ids, am, R, sharing=sharing)
        res = V.compare_values(s, z, M.grads(stock), M.grads(zorro))
        both = [torch.empty_like(z) for _ in range(world)]
        dist.all_gather(both, z)
        res["ranks_equal"] = bool(all(torch.equal(both[0], x) for x in both))
        res["sp"] = bool(zorro.config.sequence_parallel)
        res["dedup"] = plan.T < plan.ordinary_tokens
        out[sharing] = res
    return out


def run_rank(rank: int, world: int, init_file: str, ckpt: str) -> dict:
    from tests.support import megatron_engines as E

    E.start_rank(rank, world, init_file, ckpt)
    out = {}
    for layout, (tp, dynamic) in LAYOUTS.items():
        t0 = time.time()
        # TP = 1 over 2 ranks is DP = 2 with unequal shares (8 and 4 rows): the ranks' own packings differ
        rows = (slice(0, 8) if rank == 0 else slice(8, 12)) if tp == 1 and world > 1 else None
        stock, zorro, built = _engines(E, ckpt, tp)
        res = _steps(E, stock, zorro, partial(make_value_batch, E, rows=rows, dynamic=dynamic), rank)
        res["built"] = built
        res["seconds"] = time.time() - t0
        out[layout] = res
    t0 = time.time()
    out["fp64_tp2_sp"] = _fp64_tp2_sp(rank, world, init_file)
    out["fp64_tp2_sp"]["seconds"] = time.time() - t0
    return out


if __name__ == "__main__":
    rank_main(run_rank, str)
