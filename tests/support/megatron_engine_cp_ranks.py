"""One rank of the context-parallel Megatron *engine* check (tests/integrations/megatron/test_engine_cp.py): verl
0.9.1's Megatron engine built by Megatron-Bridge, fp32 on the CPU, 4 processes (gloo). zorro's engine at
CP = 2 x TP = 2 + sequence parallel (DP = 1) and at CP = 2 (TP = 1, DP = 2) against zorro at CP = 1 and verl's stock
engine at CP = 1 on the same batch (megatron's local attention has no CP exchange: stock CP is a GPU test).

Every DP rank gets the whole 12-row batch (:func:`tests.support.megatron_engines.make_batch`): with verl's global
normalisers (``batch_num_tokens`` summed over DP, ``dp_size``) and DDP's mean, identical DP shares give the DP = 1
gradient exactly, so the CP = 1 references (DP = 2 at TP = 2, DP = 4 at TP = 1) and the CP = 2 runs (DP = 1 / 2)
compute the same numbers. Megatron's rank order is TP, CP, DP: a process keeps its TP rank across the layouts, so its
gradient shards compare by name. Megatron's parallel state is global, so the references run first and are recorded
(log-probs / entropy before training, the loss, every gradient and every parameter at each of two SGD steps); then
the CP = 2 engines run and are compared with them.

Cases (``CASES``): ``cp2tp2/fixed`` and ``cp2pp2/fixed`` (PP = 2: each stage sends its CP share of the packed row;
per-token loss regime), ``cp2/fixed`` (megatron's ordinary regime),
``cp2/dynamic`` and ``cp2/prefix`` (``sharing=prefix``, dynamic budget; both per-token; both on the varlen CP
attention, ``flash_copyfree`` on PyTorch's CPU flash kernels, against references on ``sdpa``), and ``cp2/floor_count``:
``cp2/fixed`` per-token with verl's own CP token count (``n // cp`` on every CP rank) instead of zorro's exact share,
the control that shows the comparison sees the count; ``stock_cp2/fixed``: verl's **stock** engine at CP = 2 (its THD
path, the CPU stand-in of Transformer Engine's CP attention, tests/support/megatron_cp_stock.py) against stock at
CP = 1, and ``cp2/fixed`` also against it (zorro and stock at the same sharding); the critic (verl's value-head
engine, :func:`_critic_run`) at CP = 2 x DP = 2 in both regimes. Then the model-time refusals (:func:`_refusals`).

Run as ``python -m tests.support.megatron_engine_cp_ranks RANK 4 INIT_FILE CKPT_DIR OUT_JSON``.
"""

from __future__ import annotations

import time
from functools import partial

import torch

from tests.support.multi_rank import first_metric, rank_main

ZORRO = {"enable": True, "rollout_n": 4, "attention_backend": "sdpa"}
PREFIX = {**ZORRO, "sharing": "prefix", "min_shared_len": 1}
#: the CP = 2 dynamic and prefix cases run the varlen CP attention (PyTorch's CPU flash kernels), compared with the
#: CP = 1 references on the dense one
FLASH, PREFIX_FLASH = ({**z, "attention_backend": "flash_copyfree"} for z in (ZORRO, PREFIX))
PER_TOKEN = {"calculate_per_token_loss": True}
STEPS = 2
_LAST_RUN: list = []  # the last recorded run (compared with a further reference)


def _run(E, eng, td_of) -> dict:
    """log-probs / entropy (``infer_batch``, before training), then ``STEPS`` x ``train_batch`` (SGD): the summed
    micro-batch losses, every gradient and every parameter after each step; the zorro metrics."""
    out = {}
    td = td_of()
    with eng.eval_mode():
        res = eng.infer_batch(td, loss_function=None)
    if "model_output" in res:  # (under PP: the last stage)
        out["log_probs"] = E.response_values(res["model_output"]["log_probs"], td)
        out["entropy"] = E.response_values(res["model_output"]["entropy"], td)
    out["infer_metrics"] = {k: first_metric(v) for k, v in res.get("metrics", {}).items() if k.startswith("zorro/")}
    for step in range(1, STEPS + 1):
        with eng.train_mode(zero_grad_on_exit=False):
            tr = eng.train_batch(td_of(), loss_function=E.ppo_loss_fn())
        if "loss" in tr:
            out[f"step{step}/loss"] = float(sum(tr["loss"]))
        out[f"step{step}/grads"] = E.grads(eng)
        out[f"step{step}/params"] = {k: p.detach().clone() for k, p in E.gpt_of(eng).named_parameters()}
        out[f"step{step}/metrics"] = {k: first_metric(v) for k, v in tr.get("metrics", {}).items()
                                      if k.startswith("zorro/")}
    return out


def _diff(z: dict, ref: dict) -> dict:
    """Max errors of run ``z`` against run ``ref``: values absolute, losses relative, gradients relative to each
    parameter's largest entry, parameters absolute."""
    assert ("log_probs" in z) == ("log_probs" in ref), "a rank with outputs in one layout only"
    out = {}
    if "log_probs" in ref:  # (under PP: the last stage)
        out["log_probs"] = (z["log_probs"] - ref["log_probs"]).abs().max().item()
        out["entropy"] = (z["entropy"] - ref["entropy"]).abs().max().item()
    for step in range(1, STEPS + 1):
        if f"step{step}/loss" in ref:
            lz, lr = z[f"step{step}/loss"], ref[f"step{step}/loss"]
            out[f"step{step}/loss_rel"] = abs(lz - lr) / abs(lr)
        gz, gr = z[f"step{step}/grads"], ref[f"step{step}/grads"]
        assert gz.keys() == gr.keys(), (sorted(gz), sorted(gr))
        out[f"step{step}/grad_rel"] = max(((gz[k] - gr[k]).abs().max() / gr[k].abs().max().clamp_min(1e-30)).item()
                                          for k in gr)
        pz, pr = z[f"step{step}/params"], ref[f"step{step}/params"]
        out[f"step{step}/params"] = max((pz[k] - pr[k]).abs().max().item() for k in pr)
    return out


def _critic_run(E, eng, head: torch.Tensor) -> dict:
    """verl's Megatron critic: its value head set to ``head`` (each engine draws its own), then two steps as the
    trainer runs them, ``infer_batch`` (``compute_values``) and ``train_batch`` with verl's ``value_loss``
    (``update_critic``, one SGD step), each on a new batch (the whole batch on every DP rank, fixed micro-batches):
    the values at the positions verl reads, the loss, every gradient and every parameter after each step."""
    from tests.support.megatron_value_ranks import make_value_batch
    from tests.support.verl_engines import value_loss_fn

    with torch.no_grad():
        E.gpt_of(eng).output_layer.weight.copy_(head)
    out = {}
    for step in range(1, STEPS + 1):
        td = make_value_batch(E, seed=step, rows=None, dynamic=False)
        with eng.eval_mode():
            res = eng.infer_batch(make_value_batch(E, seed=step, rows=None, dynamic=False), loss_function=None)
        out[f"step{step}/values"] = E.response_values(res["model_output"]["values"], td)
        out[f"step{step}/infer_metrics"] = {k: first_metric(v) for k, v in res.get("metrics", {}).items()
                                            if k.startswith("zorro/")}
        with eng.train_mode(zero_grad_on_exit=False):
            tr = eng.train_batch(make_value_batch(E, seed=step, rows=None, dynamic=False),
                                 loss_function=value_loss_fn())
        out[f"step{step}/loss"] = float(sum(tr["loss"]))
        out[f"step{step}/grads"] = E.grads(eng)
        out[f"step{step}/params"] = {k: p.detach().clone() for k, p in E.gpt_of(eng).named_parameters()}
        out[f"step{step}/metrics"] = {k: first_metric(v) for k, v in tr.get("metrics", {}).items()
                                      if k.startswith("zorro/")}
    return out


def _critic_diff(z: dict, ref: dict) -> dict:
    out = {}
    for step in range(1, STEPS + 1):
        out[f"step{step}/values"] = (z[f"step{step}/values"] - ref[f"step{step}/values"]).abs().max().item()
        lz, lr = z[f"step{step}/loss"], ref[f"step{step}/loss"]
        out[f"step{step}/loss_rel"] = abs(lz - lr) / abs(lr)
        gz, gr = z[f"step{step}/grads"], ref[f"step{step}/grads"]
        assert gz.keys() == gr.keys(), (sorted(gz), sorted(gr))
        out[f"step{step}/grad_rel"] = max(((gz[k] - gr[k]).abs().max() / gr[k].abs().max().clamp_min(1e-30)).item()
                                          for k in gr)
        pz, pr = z[f"step{step}/params"], ref[f"step{step}/params"]
        out[f"step{step}/params"] = max((pz[k] - pr[k]).abs().max().item() for k in pr)
    return out


def _micro_batch_tokens(zorro, td) -> list:
    """Each of the engine's last micro-batches' ordinary tokens (its rows' prompt + response lengths)."""
    from zorro_verl.integrations.verl.v09.batching import row_lengths

    p, r = row_lengths(td)
    return [int(sum(int(p[b]) + int(r[b]) for b in mb)) for mb in zorro.zorro_last_micro_batches.batches]


def run_rank(rank: int, world: int, init_file: str, ckpt: str) -> dict:
    from megatron.core import parallel_state as mpu

    from tests.support import megatron_engines as E

    assert world == 4, world
    E.start_rank(rank, world, init_file, ckpt)
    t_start = time.time()
    build = partial(E.build_engine, bridge="megatron-bridge")
    plain = partial(E.make_batch, dynamic=False)
    dynamic = partial(E.make_batch, dynamic=True)
    prefix = partial(E.make_batch, dynamic=True, shared_prefix=True)
    out, seconds = {}, {}

    def cp_engine(zorro, tp, overrides, pp=1):
        eng = build(ckpt, zorro=zorro, tp=tp, pp=pp, engine_kwargs={"context_parallel_size": 2},
                    transformer_overrides=overrides)
        assert mpu.get_context_parallel_world_size() == 2 and mpu.get_tensor_model_parallel_world_size() == tp
        return eng

    def record(name, eng, td_of, ref_stock, ref_zorro1):
        run = _run(E, eng, td_of)
        _LAST_RUN[:] = [run]
        gpt = E.gpt_of(eng)
        out[name] = {"vs_stock": _diff(run, ref_stock), "vs_zorro_cp1": _diff(run, ref_zorro1),
                     "cp": mpu.get_context_parallel_world_size(), "tp": mpu.get_tensor_model_parallel_world_size(),
                     "pp": mpu.get_pipeline_model_parallel_world_size(),
                     "last_stage": mpu.is_pipeline_last_stage(ignore_virtual=True),
                     "dp": mpu.get_data_parallel_world_size(), "sp": bool(gpt.config.sequence_parallel),
                     "per_token_loss": bool(gpt.config.calculate_per_token_loss),
                     "deduplicated": eng.zorro_active and eng._zorro_static_reason is None,
                     "metrics": {**run["infer_metrics"], **{f"train/{k}": v for k, v in
                                                             run[f"step{STEPS}/metrics"].items()}},
                     "micro_batch_tokens": _micro_batch_tokens(eng, td_of()),
                     "n_tokens": int(run["log_probs"].numel()) if "log_probs" in run else None,
                     "n_params": len(run["step1/grads"])}

    # ---- TP = 2 + SP: references at CP = 1 (DP = 2), then zorro at CP = 2 (DP = 1), per-token regime
    t0 = time.time()
    ref = {name: _run(E, build(ckpt, zorro=z, tp=2, remove_padding=z is not None), plain)
           for name, z in (("stock", None), ("zorro", ZORRO))}
    record("cp2tp2/fixed", cp_engine(ZORRO, 2, PER_TOKEN), plain, ref["stock"], ref["zorro"])
    seconds["cp2tp2"] = time.time() - t0

    # ---- PP = 2: references at CP = 1 (DP = 2), then zorro at CP = 2 x PP = 2 (DP = 1), per-token regime (the last
    # stage's count broadcast to the first by finalize_model_grads)
    t0 = time.time()
    ref = {name: _run(E, build(ckpt, zorro=z, pp=2, remove_padding=z is not None), plain)
           for name, z in (("stock", None), ("zorro", ZORRO))}
    record("cp2pp2/fixed", cp_engine(ZORRO, 1, PER_TOKEN, pp=2), plain, ref["stock"], ref["zorro"])
    seconds["cp2pp2"] = time.time() - t0

    # ---- TP = 1: references at CP = 1 (DP = 4), then zorro at CP = 2 (DP = 2)
    t0 = time.time()
    ref = {(name, batch): _run(E, build(ckpt, zorro=z, tp=1, remove_padding=z is not None), td_of)
           for batch, td_of, zz in (("plain", plain, ZORRO), ("prefix", prefix, PREFIX))
           for name, z in (("stock", None), ("zorro", zz))}
    # the critic (verl's value-head engine; values ~1): stock and zorro at CP = 1, the stock engine's head for all
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithValueHead

    from tests.support.megatron_value_ranks import MAX_TOKENS

    value_kw = dict(tp=1, model_type="value_model", max_tokens=MAX_TOKENS)
    stock_critic = build(ckpt, zorro=None, remove_padding=False, engine_cls=MegatronEngineWithValueHead, **value_kw)
    head = E.gpt_of(stock_critic).output_layer.weight.detach().clone()
    ref_critic = {"stock": _critic_run(E, stock_critic, head),
                  "zorro": _critic_run(E, build(ckpt, zorro=ZORRO, **value_kw), head)}
    seconds["cp1_references"] = time.time() - t0
    # stock CP = 2 (DP = 2): verl's stock engine on its THD path with the CPU stand-in of TE's CP attention
    # (tests/support/megatron_cp_stock.py), checked against the stock CP = 1 reference, then zorro's CP = 2 against it
    t0 = time.time()
    stock_cp2 = _run(E, build(ckpt, zorro=None, tp=1, remove_padding=True,
                              engine_kwargs={"context_parallel_size": 2}), plain)
    assert mpu.get_context_parallel_world_size() == 2
    out["stock_cp2/fixed"] = {"vs_stock": _diff(stock_cp2, ref[("stock", "plain")]),
                              "cp": mpu.get_context_parallel_world_size(), "dp": mpu.get_data_parallel_world_size()}
    seconds["stock_cp2"] = time.time() - t0
    t0 = time.time()
    for name, zorro, td_of, batch, overrides in (("cp2/fixed", ZORRO, plain, "plain", {}),
                                                  ("cp2/dynamic", FLASH, dynamic, "plain", PER_TOKEN),
                                                  ("cp2/prefix", PREFIX_FLASH, prefix, "prefix", PER_TOKEN)):
        record(name, cp_engine(zorro, 1, overrides), td_of, ref[("stock", batch)], ref[("zorro", batch)])
        if name == "cp2/fixed":  # the same sharding on both sides: zorro CP = 2 vs stock CP = 2
            out[name]["vs_stock_cp2"] = _diff(_LAST_RUN[0], stock_cp2)
    # the critic at CP = 2 (DP = 2), ordinary and per-token regimes
    for name, overrides in (("critic_cp2/fixed", {}), ("critic_cp2_per_token/fixed", PER_TOKEN)):
        eng = build(ckpt, zorro=ZORRO, engine_kwargs={"context_parallel_size": 2}, transformer_overrides=overrides,
                    **value_kw)
        assert type(eng).__name__ == "ZorroMegatronEngineWithValueHead", type(eng)
        run = _critic_run(E, eng, head)
        out[name] = {"vs_stock": _critic_diff(run, ref_critic["stock"]),
                     "vs_zorro_cp1": _critic_diff(run, ref_critic["zorro"]),
                     "cp": mpu.get_context_parallel_world_size(), "dp": mpu.get_data_parallel_world_size(),
                     "per_token_loss": bool(E.gpt_of(eng).config.calculate_per_token_loss),
                     "deduplicated": eng.zorro_active and eng._zorro_static_reason is None,
                     "metrics": {**run["step1/infer_metrics"], **{f"train/{k}": v for k, v in
                                                                   run[f"step{STEPS}/metrics"].items()}},
                     "n_values": int(run["step1/values"].numel()),
                     "values_scale": run["step1/values"].abs().max().item()}
    # the control: verl's own count (n // cp on every CP rank) in place of zorro's exact share (imported here: a
    # zorro engine module imported before verl's engines defers the engine registration)
    from zorro_verl.integrations.verl.v09 import megatron_engine

    exact = megatron_engine._cp_token_share
    megatron_engine._cp_token_share = lambda loss_func, n_tokens, output: loss_func(output)
    try:
        record("cp2/floor_count", cp_engine(ZORRO, 1, PER_TOKEN), plain, ref[("stock", "plain")],
               ref[("zorro", "plain")])
    finally:
        megatron_engine._cp_token_share = exact
    seconds["cp2"] = time.time() - t0
    t0 = time.time()
    out["refusals"] = _refusals(E, build, ckpt, rank)
    seconds["refusals"] = time.time() - t0
    seconds["all_cases"] = time.time() - t_start
    out["seconds"] = seconds
    return out


def _refusals(E, build, ckpt: str, rank: int) -> dict:
    """What zorro's engine still refuses once the model is built (``on_unsupported=raise``): a Qwen3-MoE model at
    CP = 2 (TP = 1, DP = 2; the routers without losses, as verl configures them), and at CP = 1 the per-token regime
    with the router's load-balancing loss on."""
    import os

    import torch.distributed as dist

    from tests.support.megatron_engine_ranks import MOE_CPU

    path = f"{ckpt}_qwen3_moe"
    if rank == 0 and not os.path.exists(os.path.join(path, "config.json")):
        E.save_tiny_checkpoint(path, "qwen3_moe")
    dist.barrier()
    out = {}
    for name, kw in (("moe_cp2", dict(engine_kwargs={"context_parallel_size": 2}, transformer_overrides=MOE_CPU)),
                     ("moe_aux_loss_per_token", dict(transformer_overrides={
                         **MOE_CPU, **PER_TOKEN, "moe_router_load_balancing_type": "aux_loss",
                         "moe_aux_loss_coeff": 0.01}))):
        try:
            build(path, zorro=ZORRO, **kw)
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    return out


if __name__ == "__main__":
    rank_main(run_rank, str)
