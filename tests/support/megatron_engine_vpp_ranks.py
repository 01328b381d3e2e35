"""One rank of the zorro-vs-stock Megatron engine check with virtual pipeline stages
(tests/integrations/megatron/test_engine_vpp.py): PP = 2 x VPP = 2 on a 4-layer Qwen3 checkpoint (one layer per model
chunk, megatron's interleaved 1F1B schedule with verl's ``overlap_p2p_comm=True`` / ``batch_p2p_comm=False``), fp32 on
the CPU over gloo, verl's stock engine (padded bshd path, megatron's own attention) as the reference;
``use_fused_kernels=True`` on the zorro engine against the stock (non-fused) engine; a batch with bad position ids on
one rank only (every rank must raise, none wait) — once per installed model builder (Megatron-Bridge first, then
vanilla mbridge: ``{bridge: {case: result}}``). Then, on the first builder, the dropout refusal at ``initialize``.

Run as ``python -m tests.support.megatron_engine_vpp_ranks RANK WORLD INIT_FILE CKPT_DIR OUT_JSON``.
"""

from __future__ import annotations

import time
from functools import partial

import torch

from tests.support.multi_rank import first_metric, rank_main

ZORRO = {"enable": True, "rollout_n": 4, "attention_backend": "sdpa"}
VPP = {"virtual_pipeline_model_parallel_size": 2}


def _chunk_params(engine) -> dict:
    """Every parameter of every model chunk of this stage, by ``chunk<i>.<name>``."""
    from verl.utils.megatron_utils import unwrap_model

    return {f"chunk{i}.{n}": p for i, c in enumerate(engine.module) for n, p in unwrap_model(c).named_parameters()}


def _chunk_grads(engine) -> dict:
    out = {}
    for name, p in _chunk_params(engine).items():
        g = getattr(p, "main_grad", None)
        g = p.grad if g is None else g
        assert g is not None, f"{name}: no gradient"
        out[name] = g.detach().clone()
    return out


def _compare(E, stock, zorro, td_of) -> dict:
    """infer + train on both engines (``td_of(name)`` builds each engine's batch): max abs diffs of log-probs /
    entropy (last stage), relative loss and grad norm, every chunk's gradients (relative to each parameter's largest
    entry) and parameters after one SGD step."""
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
    train = {}
    for name, eng in (("stock", stock), ("zorro", zorro)):
        with eng.train_mode(zero_grad_on_exit=False):
            train[name] = eng.train_batch(td_of(name), loss_function=E.ppo_loss_fn())
    gs, gz = _chunk_grads(stock), _chunk_grads(zorro)
    assert gs.keys() == gz.keys()
    rel = {k: ((gz[k] - gs[k]).abs().max() / gs[k].abs().max().clamp_min(1e-30)).item() for k in gs}
    out["grad_rel"] = max(rel.values())
    out["grad_rel_worst"] = max(rel, key=rel.get)
    out["grad_chunks"] = sorted({k.split(".")[0] for k in gs})
    out["n_params"] = len(gs)
    ps, pz = _chunk_params(stock), _chunk_params(zorro)
    out["param_after_step"] = max((pz[k] - ps[k]).abs().max().item() for k in ps)
    out["n_micro_batches"] = len(zorro.zorro_last_micro_batches.batches)
    if last:
        ls, lz = sum(train["stock"]["loss"]), sum(train["zorro"]["loss"])
        out["loss_rel"] = abs(lz - ls) / abs(ls)
        out["train_fallback"] = first_metric(train["zorro"]["metrics"].get("zorro/fallback_batches"))
    if "grad_norm" in train["stock"].get("metrics", {}):
        gn_s = first_metric(train["stock"]["metrics"]["grad_norm"])
        gn_z = first_metric(train["zorro"]["metrics"]["grad_norm"])
        out["grad_norm_rel"] = abs(gn_z - gn_s) / gn_s
    return out


def _chunks(engine) -> list:
    """Per model chunk of this stage: (layers, pre_process, post_process)."""
    from verl.utils.megatron_utils import unwrap_model

    return [[len(unwrap_model(c).decoder.layers), bool(unwrap_model(c).pre_process),
             bool(unwrap_model(c).post_process)] for c in engine.module]


def _batch(E, *, dynamic: bool, fused: bool = False, bad_positions: bool = False, micro_batch: int = 2):
    from verl.utils import tensordict_utils as tu

    td = E.make_batch(dynamic=dynamic, micro_batch=micro_batch)
    if fused:  # what verl's actor sets from actor.use_fused_kernels
        tu.assign_non_tensor(td, use_fused_kernels=True)
    if bad_positions:  # row 0 counts from 1: not verl's text layout
        pos = td["position_ids"]
        vals = pos.values().clone()
        off = pos.offsets()
        vals[off[0]:off[1]] += 1
        td["position_ids"] = torch.nested.nested_tensor_from_jagged(vals, off)
    return td


def _compare_cases(E, build, ckpt: str, rank: int, world: int) -> dict:
    """The zorro-vs-stock comparisons on the engines ``build`` makes: layout, fixed / dynamic / fixed4 micro-batches,
    a batch with bad position ids on one rank, ``use_fused_kernels``."""
    out = {}
    t0 = time.time()
    stock = build(ckpt, zorro=None, pp=world, remove_padding=False, engine_kwargs=VPP)
    zorro = build(ckpt, zorro=ZORRO, pp=world, engine_kwargs=VPP)
    out["vanilla"] = bool(zorro.vanilla_bridge)
    assert type(zorro).__name__ == "ZorroMegatronEngineWithLMHead", type(zorro)
    out["chunks"] = _chunks(zorro)
    out["tf_config"] = {k: getattr(zorro.tf_config, k) for k in (
        "virtual_pipeline_model_parallel_size", "overlap_p2p_comm", "batch_p2p_comm", "variable_seq_lengths",
        "microbatch_group_size_per_vp_stage")}
    for mode in ("fixed", "dynamic"):
        out[f"vpp/{mode}"] = _compare(E, stock, zorro, lambda _n, d=mode == "dynamic": _batch(E, dynamic=d))
    # zorro with 4 rows per micro-batch: the 3 groups of 4 rollouts pack into 3 micro-batches, rounded up to 4 (the
    # interleaved schedule runs groups of microbatch_group_size_per_vp_stage = 2). verl's fixed-size split asserts
    # that the count divides instead, so the stock engine runs 2 rows per micro-batch (6): the loss normalisers are
    # the mini-batch's, the numbers do not depend on the split
    out["vpp/fixed4"] = _compare(E, stock, zorro,
                                 lambda n: _batch(E, dynamic=False, micro_batch=4 if n == "zorro" else 2))
    out["vpp/seconds"] = time.time() - t0

    # bad position ids on rank 1 only: rank 1's check refuses before the ranks agree, so every rank raises
    td = _batch(E, dynamic=False, bad_positions=rank == 1)
    try:
        with zorro.eval_mode():
            zorro.infer_batch(td, loss_function=None)
        out["positions"] = None
    except ValueError as e:
        out["positions"] = str(e)

    # use_fused_kernels=True: zorro's head replaces verl's fused one (Triton, CUDA only: the stock reference runs
    # the non-fused head), fresh engines
    stock = build(ckpt, zorro=None, pp=world, remove_padding=False, engine_kwargs=VPP)
    fused = build(ckpt, zorro=ZORRO, pp=world, engine_kwargs={**VPP, "use_fused_kernels": True})
    out["fused_engine_setting"] = bool(fused.engine_config.use_fused_kernels)
    out["fused_static_reason"] = fused._zorro_static_reason
    out["fused/dynamic"] = _compare(E, stock, fused,
                                    lambda n: _batch(E, dynamic=True, fused=n == "zorro"))
    return out


def run_rank(rank: int, world: int, init_file: str, ckpt: str) -> dict:
    import torch.distributed as dist

    from tests.support import megatron_bridge_cpu
    from tests.support import megatron_engines as E

    E.start_rank(rank, world, init_file, ckpt, save=partial(E.save_tiny_checkpoint, layers=4))
    bridges = megatron_bridge_cpu.installed_bridges()
    # the comparisons once per model builder (Megatron-Bridge, verl's default, first), the refusals on the first
    out = {bridge: _compare_cases(E, partial(E.build_engine, bridge=bridge), ckpt, rank, world) for bridge in bridges}
    build = partial(E.build_engine, bridge=bridges[0])
    # dropout in training: refused by name when the model is built
    for name, overrides in (("hidden_dropout", {"hidden_dropout": 0.1}),
                            ("attention_dropout", {"attention_dropout": 0.1})):
        try:
            build(ckpt, zorro=ZORRO, pp=world, engine_kwargs=VPP, transformer_overrides=overrides)
            out[f"refused/{name}"] = None
        except ValueError as e:
            out[f"refused/{name}"] = str(e)
    # a forward-only engine (the reference model) runs in eval mode, where dropout is off: accepted
    ref = build(ckpt, zorro=ZORRO, pp=world, engine_kwargs={**VPP, "forward_only": True},
                transformer_overrides={"hidden_dropout": 0.1})
    out["forward_only_dropout_reason"] = ref._zorro_static_reason
    stock = build(ckpt, zorro=None, pp=world, remove_padding=False, engine_kwargs=VPP)
    res = {}
    for name, eng in (("stock", stock), ("ref", ref)):
        with eng.eval_mode():
            res[name] = eng.infer_batch(_batch(E, dynamic=True), loss_function=None)
    if "model_output" in res["ref"]:  # the last stage
        td = _batch(E, dynamic=True)
        s, r = (E.response_values(res[n]["model_output"]["log_probs"], td) for n in ("stock", "ref"))
        out["forward_only_dropout_log_probs"] = (r - s).abs().max().item()
        out["forward_only_dropout_fallback"] = first_metric(res["ref"]["metrics"].get("zorro/fallback_batches"))
    dist.barrier()
    return out


if __name__ == "__main__":
    rank_main(run_rank, str)
