"""One rank of the DeepSpeed-engine tests (tests/integrations/openrlhf/test_deepspeed.py): OpenRLHF's actor built
through OpenRLHF's own ``DeepspeedStrategy`` (``setup_distributed`` / ``prepare`` / ``backward`` /
``optimizer_step``) on DeepSpeed's CPU accelerator over gloo, a training step with OpenRLHF's stock
``Actor.forward`` and the same step with zorro's forward, for each case of a spec.

Run (by the test, once per world size, all cases in one process group)::

    DS_ACCELERATOR=cpu RANK=r WORLD_SIZE=w LOCAL_RANK=r MASTER_ADDR=127.0.0.1 ZORRO_DIST_INIT_FILE=f \\
        python -m tests.support.openrlhf_deepspeed SPEC.json

The process group comes from a ``file://`` rendezvous at ``f`` (a path that does not exist yet, the same for every
rank), made before OpenRLHF's ``setup_distributed``: ``deepspeed.init_distributed`` adopts an initialised torch
process group, so no TCP port has to be picked.

``SPEC.json``: ``{"checkpoints": {"untied": dir, "tied": dir}, "out": file, "groups": [{"stage": 2|3, "dtype":
"fp32"|"bf16", "packing": bool, "ckpt": bool (gradient checkpointing), "tied": bool (the tied-embeddings
checkpoint), "logits": ["none", "memory", ...]}, ...]}``. Rank 0 writes ``out``: per group the stock
results and per logits mode zorro's errors against them (and, for bf16 groups, both runs' errors against the fp32
group of the same stage, packing and checkpoint, whose weights are bf16-representable: the same model).

Test-only patches (this CPU host; none touches what is compared), applied by :func:`cpu_patches`:

* ``torch.cuda.set_device`` is a no-op: ``DeepspeedStrategy.setup_distributed`` calls it with ``LOCAL_RANK``
  (which ``deepspeed.init_distributed`` requires); a CPU build of torch has no CUDA runtime.
* ``init_device_mesh("cuda", ...)`` builds the same ``(dp, sp, tp)`` mesh on ``"cpu"`` (gloo).
* ``openrlhf.utils.utils.convert_to_torch_dtype`` also accepts ``"fp32"`` (OpenRLHF offers bf16 / fp16 only; with
  ``--ds.param_dtype fp32`` its DeepSpeed config enables neither, i.e. an fp32 engine: the exactness setting).
* OpenRLHF's ``AdamW`` optimizer config gains DeepSpeed's own ``"torch_adam": true``, so the engine builds
  ``torch.optim.AdamW`` (the same update rule) instead of ``FusedAdam``; and DeepSpeed's shared-memory comm op
  is marked incompatible, so its torch backend skips it (it serves only ``inference_all_reduce``, AutoTP
  inference). On the CPU accelerator both are C++ ops that DeepSpeed JIT-compiles with g++ on first use:
  measured on this 2-core host, FusedAdam ~10 min and the shm op ~2 min (busy host), far beyond the tests' budget.

DeepSpeed's CPU accelerator picks gloo itself when oneCCL's bindings are absent (``DS_ACCELERATOR=cpu``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

STUBS = Path(__file__).resolve().parent / "openrlhf_stubs"
TOKENS = 128  # token ids drawn below this (the checkpoint's vocabulary is larger)
LR = 1e-3


def cpu_patches() -> None:
    """The test-only patches listed in the module doc."""
    import deepspeed.ops
    import openrlhf.utils.deepspeed.deepspeed as ods
    import openrlhf.utils.utils as outils

    torch.cuda.set_device = lambda device: None
    mesh = ods.init_device_mesh
    ods.init_device_mesh = lambda device_type, *a, **kw: mesh("cpu", *a, **kw)
    convert = outils.convert_to_torch_dtype
    outils.convert_to_torch_dtype = lambda d: torch.float32 if d == "fp32" else convert(d)
    train_config = ods.get_train_ds_config

    def torch_adam(*args, **kwargs):
        config = train_config(*args, **kwargs)
        if config.get("optimizer", {}).get("type") == "AdamW":
            config["optimizer"]["params"]["torch_adam"] = True
        return config

    ods.get_train_ds_config = torch_adam
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # TorchBackend then builds no shm op


def strategy_args(stage: int, dtype: str, packing: bool, ckpt: bool, world: int, micro: int):
    """The ``args`` namespace OpenRLHF's CLI hands ``DeepspeedStrategy`` (the keys the strategy and actor read)."""
    ds = SimpleNamespace(param_dtype=dtype, zero_stage=stage, adam_offload=False, zpg=1, use_universal_ckpt=False,
                         grad_accum_dtype=None, overlap_comm=False, deepcompile=False, tensor_parallel_size=1,
                         ring_attn_size=1, packing_samples=packing, attn_implementation="sdpa")
    # eps (--actor.adam.eps) 1: Adam's first step lr * g / (|g| + eps) is then a well-conditioned function of the
    # gradient (|g| <= 1 after clipping); with the default 1e-8 it is ~lr * sign(g), which turns fp32 noise in
    # near-zero gradient entries into lr-sized differences (stock against a reordered stock as much as against zorro)
    adam = SimpleNamespace(lr=LR, betas=(0.9, 0.95), eps=1.0, weight_decay=0.0)
    actor = SimpleNamespace(optim="adam", adam=adam, muon=SimpleNamespace(lr=LR, momentum=0.95), max_norm=1.0,
                            lr_scheduler="constant", lr_warmup_ratio=0.0, min_lr_ratio=0.1,
                            gradient_checkpointing_enable=ckpt)
    # one micro-batch per rank and optimizer step: every backward is a gradient-accumulation boundary
    train = SimpleNamespace(batch_size=micro * world, micro_batch_size=micro, dynamic_batch_enable=False)
    return SimpleNamespace(ds=ds, actor=actor, train=train, local_rank=-1, seed=42)


def make_strategy(args):
    from openrlhf.utils.deepspeed import DeepspeedStrategy

    s = DeepspeedStrategy(seed=args.seed, max_norm=args.actor.max_norm,
                          micro_train_batch_size=args.train.micro_batch_size,
                          train_batch_size=args.train.batch_size, zero_stage=args.ds.zero_stage, args=args)
    s.setup_distributed()
    return s


def build_actor(strategy, checkpoint: str, logits=None):
    """OpenRLHF's actor as ``PolicyModelActor.init_model_from_pretrained`` builds it (ZeRO-3: loaded partitioned
    through ``HfDeepSpeedConfig``), prepared by the strategy; ``logits`` set: zorro's forward with that mode."""
    from openrlhf.models.actor import Actor

    from zorro_verl.integrations.openrlhf import actor as zactor
    from zorro_verl.integrations.verl.settings import ZorroSettings

    args = strategy.args
    (zactor.install if logits is not None else zactor.uninstall)(Actor)
    actor = Actor(checkpoint, attn_implementation="sdpa", param_dtype=args.ds.param_dtype,
                  ds_config=strategy.get_ds_train_config(), packing_samples=args.ds.packing_samples,
                  temperature=0.8)
    if args.actor.gradient_checkpointing_enable:
        actor.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    cfg = dict(optim="adam", muon=vars(args.actor.muon), adam=vars(args.actor.adam),
               lr_scheduler=args.actor.lr_scheduler, lr_warmup_ratio=args.actor.lr_warmup_ratio,
               min_lr_ratio=args.actor.min_lr_ratio, max_norm=args.actor.max_norm, scheduler_steps=10)
    actor, optim, sched = strategy.prepare((actor, cfg))
    if logits is not None:  # as at the first call, but with explicit settings (the switch's options)
        state = zactor.actor_state(actor, ZorroSettings(enable=True, attention_backend="sdpa",
                                                        logits_optimization=logits))
        state.logits_chunk_size = 7  # several chunks in the compute / memory modes
    return actor, optim, sched


def rank_batch(rank: int):
    """This rank's micro-batch (GRPO groups: interleaved siblings, 1-token / empty / multi-turn responses), old and
    reference log-prob noise and advantages, drawn per rank."""
    from tests.support.openrlhf_batches import make_samples, pad_batch

    seq, am, act = pad_batch(make_samples(vocab=TOKENS, seed=11 + rank))
    g = torch.Generator().manual_seed(100 + rank)
    B, A = act.shape
    adv = (torch.rand(B, 1, generator=g) + 0.5).expand(B, A) * act
    noise = 0.05 * torch.randn(2, B, A, generator=g)
    return seq, am, act, adv, noise


def full_params(engine, fp32_master: bool):
    """``{name: full fp32 tensor}``: each parameter's gradient (after backward) or, ``fp32_master``, its updated
    fp32 weight (after the optimizer step), gathered by DeepSpeed's ``safe_get_full_*`` (collective under ZeRO-3)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    get = safe_get_full_fp32_param if fp32_master else safe_get_full_grad
    out = {}
    for name, p in engine.module.named_parameters():
        t = get(p)
        if t is not None:
            out[name] = t.detach().float().clone()
    return out


def training_step(strategy, checkpoint: str, logits, batch, dp: int, old_base=None):
    """One OpenRLHF training step on this rank's micro-batch: the old-log-prob call (no_grad, eval), then the PPO
    loss as ``ActorPPOTrainer.training_step`` composes it (token-mean PolicyLoss + k3 KL + entropy bonus, normalised
    by the action tokens of all DP ranks), ``strategy.backward``, the full gradients, ``strategy.optimizer_step``
    and the updated fp32 weights."""
    import torch.distributed as dist
    from openrlhf.models.loss import PolicyLoss, aggregate_loss
    from openrlhf.models.utils import compute_approx_kl

    seq, am, act, adv, noise = batch
    t0 = time.perf_counter()
    actor, optim, sched = build_actor(strategy, checkpoint, logits)
    t_build = time.perf_counter() - t0
    actor.eval()
    with torch.no_grad():
        eval_lp = actor(seq, act, am).float()
    if old_base is None:  # the stock run draws them; the zorro run reuses the stock run's
        old_base = [((eval_lp + noise[i]) * act) for i in range(2)]
    old, base = old_base
    actor.train()
    tokens = act.sum().to(torch.float32)
    dist.all_reduce(tokens)
    lp, output = actor(seq, act, attention_mask=am, return_output=True, return_entropy=True)
    lp = lp.float()
    norm = dict(dp_size=dp, batch_num_tokens=float(tokens))
    actor_loss, *_ = PolicyLoss(clip_eps_low=0.2, clip_eps_high=0.28)(lp, old, adv, action_mask=act, **norm)
    kl = compute_approx_kl(lp, base, log_probs_old=old, kl_estimator="k3")
    kl_loss = aggregate_loss(kl, act, **norm)
    ent = output.entropy[:, -act.shape[1]:].float()
    loss = actor_loss + 0.01 * kl_loss - 0.01 * aggregate_loss(ent, act, **norm)
    strategy.backward(loss, actor, optim)
    grads = full_params(actor.model, fp32_master=False)
    strategy.optimizer_step(optim, actor, sched)
    weights = full_params(actor.model, fp32_master=True)
    info = engine_facts(actor.model)
    if logits is not None:
        from zorro_verl.integrations.openrlhf import actor as zactor

        info["metrics"] = zactor.pop_metrics(actor)
    out = dict(info=info, eval_lp=eval_lp, lp=lp.detach(), ent=ent.detach() * act, loss=loss.detach().float(),
               grads=grads, weights=weights, old_base=old_base, build_s=t_build,
               step_s=time.perf_counter() - t0 - t_build)
    del actor, optim, sched
    return out


def engine_facts(engine) -> dict:
    """What the strategy built: the engine class, ZeRO stage, bf16, and (ZeRO-3) whether the LM head's weight is
    DeepSpeed's partitioned placeholder after the step (and how many parameters are; those under the persistence
    threshold stay gathered once fetched)."""
    from zorro_verl.integrations.openrlhf.actor import hf_model

    params = list(engine.module.parameters())
    released = [getattr(getattr(p, "ds_status", None), "name", None) == "NOT_AVAILABLE" and p.numel() == 0
                for p in params]
    model = hf_model(engine)
    head = model.get_output_embeddings().weight
    return dict(engine=type(engine).__name__, zero_stage=engine.zero_optimization_stage(),
                bf16=engine.bfloat16_enabled(), head_partitioned=released[[p is head for p in params].index(True)],
                partitioned_params=sum(released), params=len(params),
                checkpointing=bool(getattr(model, "is_gradient_checkpointing", False)))


def _max_all(x: float) -> float:
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def errors(ref: dict, got: dict, init: dict) -> dict:
    """``got`` against ``ref`` (max over ranks): log-probs of the eval and the training call and entropy under the
    action mask (max abs), the loss (relative), gradients (worst per-tensor relative, and its parameter) and the
    updated weights (:func:`update_error`)."""
    from zorro_verl.testing.compare import max_rel_grad_error

    g_err, g_name = max_rel_grad_error(ref["grads"], got["grads"], floor=1e-30)
    u_err, u_name = update_error(ref["weights"], got["weights"], init)
    return dict(eval_lp=_max_all((got["eval_lp"] - ref["eval_lp"]).abs().max().item()),
                lp=_max_all((got["lp"] - ref["lp"]).abs().max().item()),
                ent=_max_all((got["ent"] - ref["ent"]).abs().max().item()),
                loss=_max_all(abs(got["loss"].item() - ref["loss"].item()) / abs(ref["loss"].item())),
                grad=_max_all(g_err), grad_name=g_name, update=_max_all(u_err), update_name=u_name)


def update_error(ref: dict, got: dict, init: dict) -> tuple[float, str]:
    """The updated fp32 weights: worst per-tensor ``max(|w_got - w_ref| - ulp(w_ref), 0) / max|w_ref - init|``
    and its parameter. The optimizer writes ``w + Δ`` rounded to fp32 once, so two runs whose updates ``Δ`` agree
    to within ``e`` differ by at most ``e`` plus one ulp of the weight; updates smaller than an ulp (small gradients
    on O(1) weights, e.g. norms) are not resolved by fp32 at all, in either run."""
    worst, name = 0.0, ""
    for k, w in ref.items():
        ulp = torch.nextafter(w.abs(), torch.full_like(w, float("inf"))) - w.abs()
        excess = ((got[k] - w).abs() - ulp).clamp(min=0).max().item()
        err = excess / max((w - init[k]).abs().max().item(), 1e-30)
        if err > worst:
            worst, name = err, k
    return worst, name


def initial_weights(checkpoint: str) -> dict:
    from safetensors.torch import load_file

    return {k: v.float() for k, v in load_file(str(Path(checkpoint) / "model.safetensors")).items()}


def main(spec_path: str) -> None:
    import torch.distributed as dist

    spec = json.loads(Path(spec_path).read_text())
    cpu_patches()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"file://{os.environ['ZORRO_DIST_INIT_FILE']}", rank=rank,
                            world_size=world)
    # deepspeed.initialize(dist_init_required=True) checks that the env:// variables are set (else it tries MPI)
    # before it sees the group is initialised; nothing reads the port: the group above exists
    os.environ.setdefault("MASTER_PORT", "0")
    batch = rank_batch(rank)
    results, fp32_runs = [], {}
    for grp in spec["groups"]:
        stage, dtype, packing, ckpt = grp["stage"], grp["dtype"], grp["packing"], grp.get("ckpt", False)
        checkpoint = spec["checkpoints"]["tied" if grp.get("tied") else "untied"]
        init = initial_weights(checkpoint)
        args = strategy_args(stage, dtype, packing, ckpt, world, micro=batch[0].shape[0])
        strategy = make_strategy(args)
        key = (stage, packing, ckpt, grp.get("tied", False))
        ref32 = fp32_runs.get(key) if dtype != "fp32" else None
        # a bf16 group's runs take the fp32 reference's old / reference log-probs: same loss inputs, so the two
        # differ by the engine's arithmetic only
        stock = training_step(strategy, checkpoint, None, batch, world,
                              old_base=None if ref32 is None else ref32["old_base"])
        if dtype == "fp32":
            fp32_runs[key] = stock
        res = dict(group=grp, world=world, stock_build_s=stock["build_s"], stock_step_s=stock["step_s"], zorro={},
                   **stock["info"])
        if ref32 is not None and dtype != "fp32":
            res["stock_vs_fp32"] = errors(ref32, stock, init)
        for mode in grp["logits"]:
            try:
                z = training_step(strategy, checkpoint, mode, batch, world, old_base=stock["old_base"])
            except Exception as e:  # reported per case: the test names the failing one
                res["zorro"][mode] = dict(error=f"{type(e).__name__}: {e}")
                continue
            r = errors(stock, z, init)
            r.update(build_s=z["build_s"], step_s=z["step_s"], metrics=z["info"]["metrics"])
            if ref32 is not None and dtype != "fp32":
                r["vs_fp32"] = errors(ref32, z, init)
            res["zorro"][mode] = r
        results.append(res)
    if rank == 0:
        Path(spec["out"]).write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    import importlib.util

    if importlib.util.find_spec("flash_attn") is None:  # as tests/integrations/openrlhf/conftest.py does
        sys.path.insert(0, str(STUBS))
    main(sys.argv[1])
