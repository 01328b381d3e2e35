"""One rank of the pairwise configuration matrix of the verl 0.9 FSDP engine
(tests/integrations/verl/v09/test_matrix.py): gloo with a ``file://`` rendezvous, the CPU platform, fp32; every case
of the matrix runs in the same two processes, one after the other.

Run as ``python -m tests.support.verl_matrix RANK WORLD INIT_FILE SPEC_JSON OUT_JSON``. ``SPEC_JSON`` holds the
checkpoints (``{"ckpts": {model: path}, "adapters": {model: path}, "cases": [{"id", "config": {...}}]}``; the
config keys are the matrix's factors, :data:`FACTORS`). Per case, both ranks:

1. build the case's data: per optimizer step a global padded batch (:func:`global_rows`), for ``critic=True``
   ordered by verl's ``RayPPOTrainer._balance_batch`` with zorro's hook (:func:`balanced_order`), cut into one equal
   chunk per DP rank (``dp = WORLD / sp``; the ranks of an SP group hold the same chunk);
2. run the stock reference engine (:func:`reference_settings`) and the zorro engine over two steps (inference pass,
   then a training step: :func:`tests.support.verl_engines.run_steps`, SGD :data:`~tests.support.verl_engines
   .STEPS_OPTIM`) and compare them step by step (:func:`~tests.support.verl_engines.step_errors`), or record the
   ``ValueError`` / ``TypeError`` the zorro engine raised (a refusal; both ranks raise together).

Results (per case: errors, zorro metrics, the balancing's metrics, seconds) go to ``OUT_JSON``.
"""

from __future__ import annotations

import os
import time

__all__ = ["FACTORS", "run_rank", "global_rows", "balanced_order", "reference_settings", "training_worker_mesh"]

#: The options of the matrix and their levels (the first level is each option's default).
FACTORS = {
    "model": ["dense", "vlm", "hybrid"],  # tiny Qwen3; Qwen2.5-VL (Qwen2-VL family); Qwen3.5 (gated delta-net)
    "logits": ["none", "compute", "memory"],  # zorro's logits_optimization
    "strategy": ["fsdp", "fsdp2"],
    "lora": [False, True],
    "fused": [False, True],  # verl's use_fused_kernels (torch backend)
    "sp": [1, 2],  # Ulysses sequence parallel size
    "sharing": ["prompt", "prefix"],
    "dynamic_bsz": [False, True],
    "grad_ckpt": [False, True],
    "offload": [False, True],  # fsdp_config.param_offload
    "critic": [False, True],  # a critic-present trainer: the batch ordered by zorro's balancing with a critic
}

#: Rows per prompt (rollout.n) of every batch.
N = 4
#: Fixed micro-batch size (rows) and dynamic per-GPU token budgets (text, VLM: several micro-batches per rank).
MICRO_BATCH = 4
TOKEN_BUDGET = {"dense": 40, "hybrid": 40, "vlm": 96}
FUSED_MODEL = {"use_fused_kernels": True, "fused_kernel_options": {"impl_backend": "torch"}}
PREFIX = {"sharing": "prefix", "min_shared_len": 4}


def global_rows(model: str, step: int, dp: int, vlm_config=None) -> dict:
    """The global padded batch of optimizer step ``step`` (all DP ranks' rows; ``2 * dp`` prompts x :data:`N`
    rows, shuffled: siblings interleaved), with training fields (:func:`zorro_verl.testing.batch_from_rows`) and
    ``uid`` (a list: each row's prompt index).

    * text models: ``2 * dp`` questions behind one shared 8-token system prompt (a prefix tree for
      ``sharing=prefix``, whole-prompt groups for ``prompt``), responses of 0..6 tokens (an empty and a 1-token one);
    * the VLM: :func:`tests.support.verl_vlm.vlm_base_batch` (4 prompts: one image, two images, identical tokens with
      other pixels, no image; ``N`` rollouts each; ``dp`` is 1 or 2 and the batch has 16 rows either way)."""
    import torch

    if model == "vlm":
        from tests.support.verl_vlm import vlm_base_batch

        return vlm_base_batch(vlm_config, n=N, response_len=5, seed=40 + step, shuffle=True)
    from zorro_verl.testing import batch_from_rows, shared_system_rows

    q = 2 * dp
    rows = shared_system_rows(q, N, system_len=8, question_len=3, response_len=6, vocab_size=100, seed=50 + step)
    gen = torch.Generator().manual_seed(60 + step)
    lens = torch.randint(1, 7, (len(rows),), generator=gen).tolist()
    lens[0], lens[N] = 0, 1  # an empty and a 1-token response
    rows = [(p, r[:n]) for (p, r), n in zip(rows, lens)]
    perm = torch.randperm(len(rows), generator=gen).tolist()
    base = batch_from_rows([rows[i] for i in perm], include_training_fields=True, seed=70 + step)
    base["uid"] = [i // N for i in perm]
    return base


def balanced_order(base: dict, dp_ranks: list, sharing: str, critic_mesh: str | None = None) -> tuple:
    """The row order verl's V0 ``RayPPOTrainer._balance_batch`` (with zorro's hook, ``group_balance_mode:
    keep_minibatches``) dispatches for ``base`` in a trainer with a critic: the actor's workers on the DP ranks
    ``dp_ranks`` (verl's dispatch info: each worker's DP rank; one mini-batch, the whole batch), the critic's worker
    group registered as verl 0.9.1's ``TrainingWorker`` registers it (the same workers, dispatch info under its
    ``"train"`` mesh: zorro must query that mesh, there is no ``"critic"`` one; ``critic_mesh`` overrides the name,
    for the test that shows a wrong one is caught) with two shuffled mini-batches.
    Returns ``(order, metrics, meta_info)``: positions of ``base``'s rows in dispatch order, the trainer's metrics
    and the batch's meta data (zorro's balance stamp)."""
    import types

    import numpy as np
    import torch
    import verl.trainer.ppo.ray_trainer as rt
    from omegaconf import OmegaConf
    from verl import DataProto

    from zorro_verl.integrations.verl.v09.balance import install_v0_hook

    install_v0_hook(rt)  # idempotent: the plugin's post-import hook normally installed it
    ids, am = base["input_ids"], base["attention_mask"]
    B, P = ids.shape[0], ids.shape[1] - base["responses"].shape[1]
    batch = DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": am, "prompts": ids[:, :P],
                                         "responses": base["responses"], "row": torch.arange(B)},
                                non_tensors={"uid": np.array([str(u) for u in base["uid"]], dtype=object)})
    prompts = B // N
    zorro = {"enable": True, "rollout_n": N, "sharing": sharing,
             **({"min_shared_len": PREFIX["min_shared_len"]} if sharing == "prefix" else {})}
    cfg = OmegaConf.create({
        "trainer": {"critic_warmup": 0, "balance_batch": True},
        "actor_rollout_ref": {"rollout": {"n": N}, "actor": {
            "ppo_mini_batch_size": prompts, "ppo_micro_batch_size_per_gpu": MICRO_BATCH, "ppo_epochs": 1,
            "shuffle": False, "data_loader_seed": 42, "fsdp_config": {"zorro": zorro}}},
        "critic": {"ppo_mini_batch_size": prompts // 2, "ppo_epochs": 1, "shuffle": True, "data_loader_seed": 3}})
    me = types.SimpleNamespace(config=cfg, use_critic=True, global_steps=1,
                               actor_rollout_wg=types.SimpleNamespace(_dispatch_info={"actor": list(dp_ranks)}),
                               critic_wg=types.SimpleNamespace(
                                   _dispatch_info={critic_mesh or training_worker_mesh(): list(dp_ranks)}))
    me._get_dp_size = types.MethodType(rt.RayPPOTrainer._get_dp_size, me)
    metrics: dict = {}
    rt.RayPPOTrainer._balance_batch(me, batch, metrics)
    return batch.batch["row"].tolist(), metrics, dict(batch.meta_info)


def training_worker_mesh() -> str:
    """The mesh name verl's ``TrainingWorker`` (the critic's worker in verl 0.9.1) registers its dispatch info under,
    read from its ``__init__`` (as test_balance_exact.py does): ``"train"``."""
    import inspect
    import re

    from verl.workers.engine_workers import TrainingWorker

    names = set(re.findall(r'_register_dispatch_collect_info\(\s*mesh_name="(\w+)"',
                           inspect.getsource(TrainingWorker.__init__)))
    assert len(names) == 1, names
    return names.pop()


def _chunk(base: dict, rows: list) -> dict:
    """Rows ``rows`` of a padded batch (tensors indexed; list fields picked)."""
    import torch

    idx = torch.tensor(rows)
    return {k: (v[idx] if hasattr(v, "shape") else [v[i] for i in rows]) for k, v in base.items()}


def reference_settings(cfg: dict) -> dict:
    """What the stock reference engine of a case differs in from the zorro engine, and why:

    * no Ulysses SP: verl's own SP attention is a flash-attn path; the stock engine without SP on the same ranks
      (both ranks of the SP group hold the same batch, so as two DP ranks they compute the same global step) is the
      reference test_ulysses.py checks against too;
    * no fused kernels: verl 0.9.1's fused forward reads ``lm_head.weight`` without calling the head module and fails
      under FSDP2 on untied heads (test_fused.py); the stock engine without them computes the same math;
    * the hybrid (Qwen3.5) runs padded (``use_remove_padding=False``): its CPU remove-padding path leaks the
      delta-net state across packed rows (test_hybrid_engine.py);
    * the VLM runs verl's remove-padding path with the test-only CPU stand-ins of its flash kernels
      (:func:`tests.support.verl_vlm.cpu_stock_vlm_kernels`, as test_vlm_engine.py)."""
    return {"sp": 1, "fused": False, "use_remove_padding": cfg["model"] != "hybrid"}


def _model_classes_snapshot():
    """transformers' own methods of the text model classes verl patches process-wide (fused kernels replace the
    ``*ForCausalLM`` forward); restoring them (and the VLM classes': :func:`~tests.support.verl_vlm
    .reset_verl_patches`) before each engine gives every engine exactly its own config's patches."""
    import importlib
    import types

    saved = {}
    for name in ("qwen3", "qwen3_5"):
        mod = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        for obj in vars(mod).values():
            if isinstance(obj, type) and obj.__module__ == mod.__name__:
                saved[obj] = {k: v for k, v in vars(obj).items() if isinstance(v, types.FunctionType)}

    def restore():
        from tests.support.verl_vlm import reset_verl_patches

        for cls, fns in saved.items():
            for k, v in fns.items():
                setattr(cls, k, v)
        reset_verl_patches()

    return restore


def _engine_batch(chunk: dict, model: str, cfg: dict, rmpad: bool, fused: bool, global_rows_count: int, meta):
    from verl.utils import tensordict_utils as tu

    from tests.support.verl_engines import make_engine_batch
    from tests.support.verl_vlm import with_mm_stack

    base = with_mm_stack(chunk) if model == "vlm" else {k: v for k, v in chunk.items() if k != "uid"}
    td = make_engine_batch(base=base, temperature=0.8, calculate_entropy=True, use_dynamic_bsz=cfg["dynamic_bsz"],
                           micro_batch_size=MICRO_BATCH, max_token_len=TOKEN_BUDGET[model],
                           use_remove_padding=rmpad, global_batch_size=global_rows_count)
    tu.assign_non_tensor(td, use_fused_kernels=fused)
    if meta:  # the trainer's meta data (zorro's balance stamp), as verl hands it to the engine
        tu.assign_non_tensor(td, **meta)
    return td


def _build(spec: dict, cfg: dict, *, zorro: bool, restore):
    from tests.support.verl_engines import STEPS_OPTIM, build_engine, lora_model

    model = cfg["model"]
    sp = cfg["sp"] if zorro else 1
    fused = cfg["fused"] and zorro
    model_overrides = {}
    if cfg["lora"]:
        model_overrides.update(lora_model(spec["adapters"][model], "all-linear"))
    if fused:
        model_overrides.update(FUSED_MODEL)
    engine_overrides = {"param_offload": cfg["offload"]}
    if sp > 1:
        engine_overrides["ulysses_sequence_parallel_size"] = sp
    if fused:
        engine_overrides["use_fused_kernels"] = True
    settings = None
    if zorro:
        settings = {"logits_optimization": cfg["logits"],
                    **(PREFIX if cfg["sharing"] == "prefix" else {"sharing": "prompt"})}
    restore()
    eng = build_engine(spec["ckpts"][model], zorro=zorro, strategy=cfg["strategy"], use_dynamic_bsz=cfg["dynamic_bsz"],
                       micro_batch_size=MICRO_BATCH, max_token_len=TOKEN_BUDGET[model],
                       use_remove_padding=zorro or reference_settings(cfg)["use_remove_padding"],
                       gradient_checkpointing=cfg["grad_ckpt"], zorro_settings=settings,
                       engine_overrides=engine_overrides, model_overrides=model_overrides or None,
                       optim_overrides=STEPS_OPTIM)
    if zorro:
        eng.logits_chunk_size = 4  # several chunks per micro-batch in the compute / memory modes
    return eng


class _FusedCalls:
    """Counts the zorro engine's calls of its fused step (``engine.zorro_fused_step``): the evidence that a case
    with ``use_fused_kernels`` ran verl's fused kernels inside zorro."""

    count = 0

    @classmethod
    def install(cls) -> None:
        from zorro_verl.integrations.verl.v09 import engine

        orig = engine.zorro_fused_step

        def counted(*args, **kwargs):
            cls.count += 1
            return orig(*args, **kwargs)

        engine.zorro_fused_step = counted


def _effective(eng, got: list, batches: list) -> dict:
    """What the zorro engine of a case actually ran, per option (the test compares it with the case's config)."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from verl.utils import tensordict_utils as tu

    return {
        "strategy": "fsdp" if isinstance(eng.module, FullyShardedDataParallel) else "fsdp2",
        "lora": bool(eng._is_lora) and any("lora_A" in n for n in got[-1]["grads"]),
        "fused": _FusedCalls.count > 0,
        "sp": eng.ulysses_sequence_parallel_size,
        "sharing": eng.zorro.sharing,
        "logits": eng.zorro.logits_optimization,
        "dynamic_bsz": all(tu.get_non_tensor_data(data=td, key="use_dynamic_bsz", default=False) for td in batches),
        "grad_ckpt": any(getattr(m, "gradient_checkpointing", False) for m in eng.module.modules()),
        "offload": bool(eng.is_param_offload_enabled),
    }


def run_case(spec: dict, case: dict, rank: int, world: int, restore, vlm_config) -> dict:
    """One matrix case on this rank (see the module docstring)."""
    import contextlib
    import gc

    from tests.support.verl_engines import run_steps, step_errors
    from tests.support.verl_vlm import cpu_stock_vlm_kernels

    cfg, model = case["config"], case["config"]["model"]
    t0 = time.perf_counter()
    sp = cfg["sp"]
    dp = world // sp
    res = {"id": case["id"], "rank": rank}
    data = {False: [], True: []}  # per engine (zorro?): the batch of each step on this rank
    res["balance"] = []
    for step in range(2):
        base = global_rows(model, step, dp, vlm_config)
        B = len(base["uid"])
        order, meta = list(range(B)), None
        if cfg["critic"]:
            order, metrics, meta = balanced_order(base, [r // sp for r in range(world)], cfg["sharing"])
            res["balance"].append({k: v for k, v in metrics.items() if k.startswith("zorro/")})
            res["balance"][-1]["order_is_permutation"] = sorted(order) == list(range(B))
            res["balance"][-1]["order"] = order
        per = B // dp
        mine = _chunk(base, order[(rank // sp) * per:(rank // sp + 1) * per])
        for z in (False, True):
            rmpad = True if z else reference_settings(cfg)["use_remove_padding"]
            data[z].append(_engine_batch(mine, model, cfg, rmpad, cfg["fused"] and z, B, meta))
    stock_ctx = cpu_stock_vlm_kernels() if model == "vlm" else contextlib.nullcontext()
    with stock_ctx:
        ref = _build(spec, cfg, zorro=False, restore=restore)
        ref_steps = run_steps(ref, data[False])
    del ref
    gc.collect()
    _FusedCalls.count = 0
    try:
        eng = _build(spec, cfg, zorro=True, restore=restore)
        got = run_steps(eng, data[True])
    except (ValueError, TypeError) as e:
        res["refused"] = f"{type(e).__name__}: {e}"
        res["seconds"] = time.perf_counter() - t0
        restore()
        gc.collect()
        return res
    res["refused"] = None
    res["errors"] = step_errors(ref_steps, got, data[True])
    m = got[0]["inf"]["metrics"]
    res["dedup_ratio"] = m["zorro/dedup_ratio"][0]
    res["tree_depth"] = m.get("zorro/tree_depth", [None])[0]
    res["effective"] = _effective(eng, got, data[True])
    res["balance_hooks_missing"] = [s["inf"]["metrics"].get("zorro/balance_hooks_missing", [None])[0] for s in got]
    del eng, got, ref_steps
    restore()
    gc.collect()
    res["seconds"] = time.perf_counter() - t0
    return res


def run_rank(rank: int, world: int, init_file: str, spec_path: str) -> dict:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      VERL_ENGINE_DEVICE="cpu", OMP_NUM_THREADS="1")
    import json

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from tests.support.verl_vlm import tiny_vlm_config  # before any engine: it captures transformers' forwards

    restore = _model_classes_snapshot()
    from tests.support.verl_cpu_platform import use_cpu_platform

    use_cpu_platform()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    import verl.workers.engine  # noqa: F401  (registers the zorro engine)

    _FusedCalls.install()

    with open(spec_path) as f:
        spec = json.load(f)
    vlm_config = tiny_vlm_config(spec["vlm_family"])
    out = {"rank": rank, "cases": []}
    t0 = time.perf_counter()
    for case in spec["cases"]:
        out["cases"].append(run_case(spec, case, rank, world, restore, vlm_config))
        dist.barrier()
    out["seconds"] = time.perf_counter() - t0
    dist.destroy_process_group()
    return out


if __name__ == "__main__":
    from tests.support.multi_rank import rank_main

    rank_main(run_rank, str)
