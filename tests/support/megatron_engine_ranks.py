"""One rank of the zorro-vs-stock Megatron *engine* check (tests/integrations/megatron/test_engine.py): verl 0.9.1's
stock ``MegatronEngineWithLMHead`` (padded bshd path, megatron's own attention) and zorro's engine, fp32 on the CPU,
on the same tiny Qwen3 checkpoint and the same GRPO batch; every layout in the same processes (importing verl's
Megatron engine costs 12-40 s per process).

Run as ``python -m tests.support.megatron_engine_ranks RANK WORLD INIT_FILE CKPT_DIR LAYOUTS OUT_JSON``; ``LAYOUTS``:
comma-separated ``tp2`` (TP = 2 + sequence parallel), ``pp2`` (PP = 2), ``dp2`` (DP = 2, TP = PP = 1; rank 0 the first 8
rows, rank 1 the last 4), ``tp1`` (one process). Per layout and batch mode (fixed micro-batch size, dynamic token
budget): ``infer_batch`` log-probs / entropy and ``train_batch`` loss, grad norm, every parameter's gradient and the
parameters after the optimizer step, zorro vs stock (on the last pipeline stage for outputs; gradients and
parameters on every rank, each its own shards). Then the refusals and the ``warn`` fallback (:func:`_refusals`), and
``sharing=prefix`` on prompts with a common start and Qwen2 / Llama checkpoints (:data:`FAMILIES`), all under
TP = 2 + SP. All of it once per model builder of verl's engine: Megatron-Bridge (verl's default; when installed) and
vanilla mbridge, in the same processes.
"""

from __future__ import annotations

import contextlib
import os
import time
from functools import partial

import torch

from tests.support.multi_rank import first_metric, rank_main

ZORRO = {"enable": True, "rollout_n": 4, "attention_backend": "sdpa"}
#: besides Qwen3 (every layout): Qwen2 (q/k/v biases, no q/k norms) and Llama checkpoints, TP = 2 + SP
FAMILIES = ("qwen2", "llama")
#: verl's Megatron LoRA (Megatron-Bridge PEFT, ``model.lora``) on every linear layer; B initialised like A, so the
#: adapters change the outputs from the first step on (verl's default zero B would leave them out of the first one)
LORA = {"type": "lora", "rank": 4, "alpha": 16, "dropout": 0.0, "lora_B_init_method": "xavier",
        "target_modules": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]}


def _layout(name: str, world: int) -> tuple[int, int]:
    return {"tp2": (2, 1), "pp2": (1, 2), "dp2": (1, 1), "tp1": (1, 1)}[name] if world > 1 or name == "tp1" \
        else (1, 1)


def _compare_engines(E, stock, zorro, td_of, rank: int) -> dict:
    """infer + train on both engines; max abs diffs (None where this rank has no outputs)."""
    from megatron.core import parallel_state as mpu

    out = {}
    last = mpu.is_pipeline_last_stage(ignore_virtual=True)
    res = {}
    for name, eng in (("stock", stock), ("zorro", zorro)):
        td = td_of()
        with eng.eval_mode():
            res[name] = eng.infer_batch(td, loss_function=None)
    if last:
        td = td_of()
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
            train[name] = eng.train_batch(td_of(), loss_function=E.ppo_loss_fn())
    gs, gz = E.grads(stock), E.grads(zorro)
    rel = {k: ((gz[k] - gs[k]).abs().max() / gs[k].abs().max().clamp_min(1e-30)).item() for k in gs}
    out["grad_rel"] = max(rel.values())
    out["grad_rel_worst"] = max(rel, key=rel.get)
    out["grad_abs"] = max((gz[k] - gs[k]).abs().max().item() for k in gs)
    ps = dict(E.gpt_of(stock).named_parameters())
    pz = dict(E.gpt_of(zorro).named_parameters())
    out["param_after_step"] = max((pz[k] - ps[k]).abs().max().item() for k in ps)
    out["n_params"] = len(gs)
    out["n_micro_batches"] = len(zorro.zorro_last_micro_batches.batches)
    if last:
        # verl's per-micro-batch losses; their sum is the mini-batch loss (global normalisers)
        ls, lz = sum(train["stock"]["loss"]), sum(train["zorro"]["loss"])
        out["loss_rel"] = abs(lz - ls) / abs(ls)
        out["train_fallback"] = first_metric(train["zorro"]["metrics"].get("zorro/fallback_batches"))
    if "grad_norm" in train["stock"].get("metrics", {}):  # the model-parallel source rank's outputs
        gn_s = first_metric(train["stock"]["metrics"]["grad_norm"])
        gn_z = first_metric(train["zorro"]["metrics"]["grad_norm"])
        out["grad_norm_rel"] = abs(gn_z - gn_s) / gn_s
    return out


def _bf16(E, build, ckpt: str, world: int) -> dict:
    """bf16 engines (megatron's Float16Module around the model, as users train), TP = 2 + SP, by the relative rule:
    zorro's and stock's bf16 log-probs and gradients vs a fresh fp32 stock engine's (relative Frobenius norms)."""
    engines = {"ref": build(ckpt, zorro=None, tp=world, remove_padding=False),
               "stock": build(ckpt, zorro=None, tp=world, remove_padding=False, dtype="bfloat16"),
               "zorro": build(ckpt, zorro=ZORRO, tp=world, dtype="bfloat16")}
    lp, g = {}, {}
    for name, eng in engines.items():
        with eng.eval_mode():
            res = eng.infer_batch(E.make_batch(dynamic=False), loss_function=None)
        lp[name] = E.response_values(res["model_output"]["log_probs"], E.make_batch(dynamic=False)).double()
        with eng.train_mode(zero_grad_on_exit=False):
            eng.train_batch(E.make_batch(dynamic=False), loss_function=E.ppo_loss_fn())
        g[name] = {k: v.double() for k, v in E.grads(eng).items()}

    def rel(x, ref):
        return ((x - ref).norm() / ref.norm()).item()

    out = {"param_dtype": str(next(E.gpt_of(engines["zorro"]).parameters()).dtype)}
    for name in ("stock", "zorro"):
        out[f"{name}_log_probs"] = rel(lp[name], lp["ref"])
        out[f"{name}_grads"] = max(rel(g[name][k], g["ref"][k]) for k in g["ref"])
    return out


def _lora(E, build, ckpt: str, world: int) -> dict:
    """verl's Megatron LoRA (Megatron-Bridge PEFT), TP = 2 + SP, fixed micro-batches: two ``train_batch`` steps
    (the adapters' gradients at each, the adapters after each SGD step), then ``infer_batch`` with the adapters (the
    actor's old log-probs) and with them disabled (verl's reference for a LoRA actor, ``no_lora_adapter``)."""
    kw = dict(tp=world, model_kwargs={"lora": LORA})
    stock = build(ckpt, zorro=None, remove_padding=False, **kw)
    zorro = build(ckpt, zorro=ZORRO, **kw)
    out = {"trainable": len(E.grads_names(zorro)), "params": len(list(E.gpt_of(zorro).parameters()))}
    ps, pz = dict(E.gpt_of(stock).named_parameters()), dict(E.gpt_of(zorro).named_parameters())
    out["init_params"] = max((pz[k] - ps[k]).abs().max().item() for k in ps)
    for step in (1, 2):
        for eng in (stock, zorro):
            with eng.train_mode(zero_grad_on_exit=False):
                eng.train_batch(E.make_batch(dynamic=False), loss_function=E.ppo_loss_fn())
        gs, gz = E.grads(stock, trainable_only=True), E.grads(zorro, trainable_only=True)
        out[f"step{step}/grad_rel"] = max(((gz[k] - gs[k]).abs().max() / gs[k].abs().max().clamp_min(1e-30)).item()
                                          for k in gs)
        out[f"step{step}/params"] = max((pz[k] - ps[k]).abs().max().item() for k in ps)
    td = E.make_batch(dynamic=False)
    lp = {}
    for name, eng in (("stock", stock), ("zorro", zorro)):
        for adapter in ("on", "off"):
            with eng.eval_mode(), (eng.disable_adapter() if adapter == "off" else contextlib.nullcontext()):
                res = eng.infer_batch(E.make_batch(dynamic=False), loss_function=None)
            if "model_output" in res:
                lp[f"{name}/{adapter}"] = E.response_values(res["model_output"]["log_probs"], td)
    if lp:
        out["log_probs_on"] = (lp["zorro/on"] - lp["stock/on"]).abs().max().item()
        out["log_probs_off"] = (lp["zorro/off"] - lp["stock/off"]).abs().max().item()
        out["adapter_effect"] = (lp["stock/on"] - lp["stock/off"]).abs().max().item()
    return out


#: megatron's fused MoE paths need Transformer Engine (the bridge turns them on); the local spec's SequentialMLP
MOE_CPU = {"moe_permute_fusion": False, "moe_grouped_gemm": False, "moe_router_fusion": False}


def _moe(E, build, ckpt: str, rank: int, world: int) -> dict:
    """Qwen3-MoE through the bridge with expert parallelism over the world (EP = 2: each rank an equal DP share
    of the rows and half of the experts; megatron's all-to-all token dispatcher over gloo), fixed
    and dynamic micro-batches, as verl configures it: ``moe_router_load_balancing_type='none'`` with the HF
    coefficient (megatron computes no load-balancing loss). Plus the routers' settings as built."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from tests.support.megatron_moe import alltoall_cpu_shims

    alltoall_cpu_shims()  # M1 (tests only)
    path = f"{ckpt}_qwen3_moe"
    if rank == 0 and not os.path.exists(os.path.join(path, "config.json")):
        E.save_tiny_checkpoint(path, "qwen3_moe")
    dist.barrier()
    kw = dict(engine_kwargs={"expert_model_parallel_size": world}, transformer_overrides=MOE_CPU)
    stock = build(path, zorro=None, remove_padding=False, **kw)
    zorro = build(path, zorro=ZORRO, **kw)
    routers = [m for m in E.gpt_of(zorro).modules() if type(m).__name__ == "TopKRouter"]
    out = {"moe_built": {"ep": mpu.get_expert_model_parallel_world_size(), "routers": len(routers),
                         "aux_loss_enabled": any(r.is_aux_loss_enabled() for r in routers),
                         "coeff": E.gpt_of(zorro).config.moe_aux_loss_coeff,
                         "type": E.gpt_of(zorro).config.moe_router_load_balancing_type,
                         "local_experts": E.gpt_of(zorro).decoder.layers[0].mlp.num_local_experts,
                         "experts_from_checkpoint": _experts_from_checkpoint(E.gpt_of(zorro), path)}}
    # equal DP shares: the all-to-all dispatcher is a collective inside every forward, so the stock engine needs the
    # same micro-batch count on every rank (verl's trainer hands the DP ranks equal shares)
    rows = slice(0, 6) if rank == 0 else slice(6, 12)
    for mode in ("fixed", "dynamic"):
        out[f"moe_ep2/{mode}"] = _compare_engines(
            E, stock, zorro, partial(E.make_batch, dynamic=mode == "dynamic", rows=rows), rank)
    return out


def _experts_from_checkpoint(gpt, path: str) -> list:
    """Which checkpoint expert each of this rank's local experts holds (layer 0; ``None`` where its weights match
    none): the bridge's expert-parallel mapping puts global expert ``ep_rank * local + i`` at local index ``i``."""
    from megatron.core import parallel_state as mpu
    from safetensors.torch import load_file

    hf = load_file(os.path.join(path, "model.safetensors"))
    n = gpt.config.num_moe_experts
    held = []
    for expert in gpt.decoder.layers[0].mlp.experts.local_experts:
        w = expert.linear_fc2.weight.detach().float()
        held.append(next((g for g in range(n) if torch.equal(hf[f"model.layers.0.mlp.experts.{g}.down_proj.weight"]
                                                             .float(), w)), None))
    assert mpu.get_tensor_model_parallel_world_size() == 1  # fc2 unsplit: compared whole
    return held


def run_rank(rank: int, world: int, init_file: str, ckpt: str, layouts: str) -> dict:
    """Every check on each installed bridge (Megatron-Bridge, verl's default, first; then vanilla mbridge):
    ``{bridge: {check: result}}``."""
    from tests.support import megatron_bridge_cpu
    from tests.support import megatron_engines as E

    E.start_rank(rank, world, init_file, ckpt)
    bridges = megatron_bridge_cpu.installed_bridges()
    return {bridge: _run_bridge(E, partial(E.build_engine, bridge=bridge), rank, world, ckpt, layouts)
            for bridge in bridges}


def _run_bridge(E, build, rank: int, world: int, ckpt: str, layouts: str) -> dict:
    import torch.distributed as dist

    out = {}
    for layout in layouts.split(","):
        t0 = time.time()
        tp, pp = _layout(layout, world)
        # DP: unequal shares (8 and 4 rows), so the ranks' own packings need different micro-batch counts
        rows = (slice(0, 8) if rank == 0 else slice(8, 12)) if layout == "dp2" else None
        stock = build(ckpt, zorro=None, tp=tp, pp=pp, remove_padding=False)
        zorro = build(ckpt, zorro=ZORRO, tp=tp, pp=pp)
        assert type(zorro).__name__ == "ZorroMegatronEngineWithLMHead", type(zorro)
        # which builder made the engines: Megatron-Bridge leaves its model provider on the engine
        out["builder"] = {name: {"vanilla": bool(eng.vanilla_bridge), "provider": type(eng.provider).__name__
                                 if eng.provider is not None else None} for name, eng in (("stock", stock),
                                                                                           ("zorro", zorro))}
        for mode in ("fixed", "dynamic"):
            out[f"{layout}/{mode}"] = _compare_engines(
                E, stock, zorro, partial(E.make_batch, dynamic=mode == "dynamic", rows=rows), rank)
        out[f"{layout}/seconds"] = time.time() - t0
    out["refusals"] = _refusals(E, build, ckpt, zorro)
    # sharing=prefix (the prefix tree), TP = 2 + SP, dynamic token budget
    stock = build(ckpt, zorro=None, tp=world, remove_padding=False)
    zorro = build(ckpt, zorro={**ZORRO, "sharing": "prefix", "min_shared_len": 1}, tp=world)
    out["prefix/dynamic"] = _compare_engines(E, stock, zorro, partial(E.make_batch, dynamic=True, shared_prefix=True),
                                             rank)
    out["bf16"] = _bf16(E, build, ckpt, world)
    if build.keywords["bridge"] == "megatron-bridge":  # verl's Megatron LoRA needs Megatron-Bridge
        out["lora"] = _lora(E, build, ckpt, world)
    out.update(_moe(E, build, ckpt, rank, world))
    for family in FAMILIES:  # the other dense families verl's Megatron engine builds, TP = 2 + SP, fixed sizes
        path = f"{ckpt}_{family}"
        if rank == 0 and not os.path.exists(os.path.join(path, "config.json")):
            E.save_tiny_checkpoint(path, family)
        dist.barrier()
        stock = build(path, zorro=None, tp=world, remove_padding=False)
        zorro = build(path, zorro=ZORRO, tp=world)
        out[f"{family}/fixed"] = _compare_engines(E, stock, zorro, partial(E.make_batch, dynamic=False), rank)
    dist.barrier()
    return out


def _refusals(E, build, ckpt: str, zorro) -> dict:
    """With the last layout's engines: settings refused at engine start (``on_unsupported=raise``; ``fused``, now
    accepted, must build), a batch refused on every rank, and the ``warn`` fallback (verl's stock forward, counted)."""
    out = {}
    for name, engine_kwargs, model_kwargs in (("fused", {"use_fused_kernels": True}, {}),
                                              ("lora", {}, {"lora": {**LORA, "dropout": 0.1}})):
        try:
            build(ckpt, zorro=ZORRO, engine_kwargs=engine_kwargs, model_kwargs=model_kwargs)
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    # per-row temperatures: zorro's Megatron head takes one float
    temps = torch.linspace(0.7, 1.3, 12)
    batch = lambda: E.make_batch(dynamic=False, temperature=temps)  # noqa: E731
    try:
        with zorro.eval_mode():
            zorro.infer_batch(batch(), loss_function=None)
        out["batch"] = None
    except ValueError as e:
        out["batch"] = str(e)
    # fresh engines (the layouts' engines have taken optimizer steps)
    stock = build(ckpt, zorro=None, remove_padding=False)
    warn = build(ckpt, zorro={**ZORRO, "on_unsupported": "warn"}, remove_padding=False)
    res = {}
    for name, eng in (("stock", stock), ("warn", warn)):
        with eng.eval_mode():
            res[name] = eng.infer_batch(batch(), loss_function=None)
    td = batch()
    s = E.response_values(res["stock"]["model_output"]["log_probs"], td)
    w = E.response_values(res["warn"]["model_output"]["log_probs"], td)
    out["warn_fallback"] = first_metric(res["warn"]["metrics"].get("zorro/fallback_batches"))
    out["warn_log_probs"] = (w - s).abs().max().item()
    return out


if __name__ == "__main__":
    rank_main(run_rank, str, str)
