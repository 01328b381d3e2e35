"""Helpers for testing the verl 0.9 engine plugin on CPU (used by tests/integrations/verl/v09 and its Ray workers).

Builds stock and zorro engines from the same HF checkpoint (FSDP2 or FSDP1, fp32, gloo), verl-layout batches (jagged,
as verl's trainer hands them to the engine), verl's own PPO loss, and runs / compares several training steps.
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import torch

#: The FSDP strategies the engine tests run under: FSDP2 and FSDP1 (verl's default ``strategy: fsdp``).
STRATEGIES = ("fsdp2", "fsdp")
#: The optimizer of multi-step comparisons (:func:`run_steps`): plain SGD, so the weights after a step differ from
#: stock's by the learning rate times the gradients' difference. AdamW's first step moves every weight by about
#: ``lr * sign(grad)``, also where the gradient is rounding noise, which turns 1e-7 gradient differences into
#: ``lr``-sized weight differences (measured: 8e-5 relative gradients at step 2 between verl's fused and plain stock
#: engines); later steps would then compare that noise, not the engines.
STEPS_OPTIM = {"optimizer": "SGD", "lr": 0.5}

__all__ = ["STRATEGIES", "STEPS_OPTIM", "use_cpu_value_model_loader", "value_ckpt", "make_value_batch",
           "value_loss_fn", "value_step_errors", "assert_value_steps_match", "lora_adapter", "lora_model",
           "build_engine", "head_unit_policy", "make_engine_batch", "ppo_loss_fn", "infer", "output_values",
           "response_values", "engine_grads", "run_steps", "step_errors", "assert_steps_match", "rank_batches",
           "ray_engine_worker_class", "padded_stock_vs_zorro", "assert_matches_stock", "sft_batch", "sft_loss_fn"]


def build_engine(ckpt: str, *, zorro: bool, use_dynamic_bsz: bool = False, micro_batch_size: int = 2,
                 max_token_len: int = 64, use_remove_padding: bool = True, gradient_checkpointing: bool = False,
                 zorro_settings: Optional[dict] = None, lr: float = 1e-2, engine_overrides: Optional[dict] = None,
                 model_overrides: Optional[dict] = None, attn_implementation: str = "sdpa",
                 strategy: str = "fsdp2", optim_overrides: Optional[dict] = None, compute_dtype: str = "fp32",
                 use_torch_compile: bool = False, model_type: str = "language_model"):
    """An initialised engine (zorro or stock ``FSDPEngineWithLMHead``) on the tiny checkpoint ``ckpt`` under
    ``strategy`` (``fsdp2``, or ``fsdp``: FSDP1 with verl's default wrap policy, one unit per decoder layer);
    ``model_overrides`` go to ``HFModelConfig`` (e.g. ``use_fused_kernels``), ``engine_overrides`` to the engine
    config (e.g. ``ulysses_sequence_parallel_size``), ``optim_overrides`` to the optimizer config (default: verl's
    AdamW at ``lr``; :data:`STEPS_OPTIM` for multi-step comparisons); ``attn_implementation`` is the stock model's
    attention (zorro replaces it). ``compute_dtype="bf16"``: verl's default mixed precision (fp32 parameters, bf16
    compute: ``param_dtype`` bf16, so the forward and the logits run in bf16); ``use_torch_compile``: verl's default
    (True) compiles the entropy function. ``model_type="value_model"``: the critic's engines
    (``FSDPEngineWithValueHead`` / ``ZorroFSDPEngineWithValueHead``) on a value checkpoint (:func:`value_ckpt`),
    loaded through :func:`use_cpu_value_model_loader`."""
    from verl.trainer.config.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine import FSDPEngineWithLMHead

    from zorro_verl.integrations.verl.v09.config import ZorroFSDPEngineConfig
    from zorro_verl.integrations.verl.v09.engine import ZorroFSDPEngineWithLMHead

    value = model_type == "value_model"
    if value:
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithValueHead

        from zorro_verl.integrations.verl.v09.value_engine import ZorroFSDPEngineWithValueHead

        use_cpu_value_model_loader()
    model_config = HFModelConfig(path=ckpt, load_tokenizer=False, model_type=model_type,
                                 override_config={"attn_implementation": attn_implementation},
                                 use_remove_padding=use_remove_padding,
                                 enable_gradient_checkpointing=gradient_checkpointing, **(model_overrides or {}))
    common = dict(strategy=strategy, model_dtype="fp32", use_torch_compile=use_torch_compile,
                  mixed_precision={"param_dtype": compute_dtype, "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
                  use_dynamic_bsz=use_dynamic_bsz, micro_batch_size_per_gpu=micro_batch_size,
                  infer_micro_batch_size_per_gpu=micro_batch_size, max_token_len_per_gpu=max_token_len,
                  infer_max_token_len_per_gpu=max_token_len, use_remove_padding=use_remove_padding,
                  **(engine_overrides or {}))
    if zorro:
        settings = {"enable": True, "attention_backend": "sdpa", **(zorro_settings or {})}
        engine_config = ZorroFSDPEngineConfig(zorro=settings, **common)
        cls = ZorroFSDPEngineWithValueHead if value else ZorroFSDPEngineWithLMHead
    else:
        engine_config = FSDPEngineConfig(**common)
        cls = FSDPEngineWithValueHead if value else FSDPEngineWithLMHead
    optim = FSDPOptimizerConfig(**{"lr": lr, "total_training_steps": 10, "weight_decay": 0.0, "clip_grad": 1.0,
                                   **(optim_overrides or {})})
    engine = cls(model_config=model_config, engine_config=engine_config, optimizer_config=optim,
                 checkpoint_config=CheckpointConfig())
    engine.initialize()
    return engine


def use_cpu_value_model_loader() -> None:
    """Make verl's ``load_valuehead_model`` load with the attention of the model config (``sdpa`` here) instead of
    the ``flash_attention_2`` it hard-codes (no flash-attn on CPU; verl would then fall back to trl's value-head
    wrapper). Everything else is verl's call: ``AutoModelForTokenClassification.from_pretrained`` with the config
    verl prepared (``num_labels = 1``, dropouts 0). Idempotent; the stock and zorro critics load the same way."""
    import verl.utils.model as vm

    if getattr(vm.load_valuehead_model, "_zorro_cpu", False):
        return

    def load_valuehead_model(local_path, torch_dtype, model_config, trust_remote_code):
        from transformers import AutoModelForTokenClassification

        return AutoModelForTokenClassification.from_pretrained(
            pretrained_model_name_or_path=local_path, torch_dtype=torch_dtype, config=model_config,
            attn_implementation=getattr(model_config, "_attn_implementation", None) or "sdpa",
            trust_remote_code=trust_remote_code)

    load_valuehead_model._zorro_cpu = True
    vm.load_valuehead_model = load_valuehead_model


def value_ckpt(out, seed: int = 0) -> str:
    """A tiny fp32 value model (:func:`zorro_verl.testing.tiny_value_model`: Qwen3 backbone, ``score``
    ``Linear(H, 1)``) saved under ``out`` as an HF checkpoint verl's critic loads. Returns the directory."""
    from zorro_verl.testing import tiny_value_model

    model = tiny_value_model("qwen3", dtype=torch.float32, seed=seed)
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(str(out))
    return str(out)


def make_value_batch(*, seed: int = 0, **kw):
    """:func:`make_engine_batch` with the critic's training fields as verl's trainer hands them over (padded
    ``[B, R]`` float32, zeros on pads): ``values`` (the old values, O(1) so that ``cliprange_value`` clips some
    tokens) and ``returns``."""
    from zorro_verl.testing import create_dummy_batch

    keys = ("batch_size", "num_prompts", "prompt_len", "response_len", "vocab", "shuffle")
    dk = {k: kw.pop(k) for k in keys if k in kw}
    b = create_dummy_batch(batch_size=dk.get("batch_size", 8), num_unique_prompts=dk.get("num_prompts", 3),
                           prompt_len=dk.get("prompt_len", 6), response_len=dk.get("response_len", 5), device="cpu",
                           include_training_fields=True, add_padding=True, vocab_size=dk.get("vocab", 128), seed=seed,
                           shuffle=dk.get("shuffle", True))
    gen = torch.Generator().manual_seed(seed + 1000)
    m = b["response_mask"].float()
    b["values"] = torch.randn(m.shape, generator=gen) * m
    b["returns"] = (torch.randn(m.shape, generator=gen) + 0.5) * m
    return make_engine_batch(base=b, **kw)


def value_loss_fn(loss_agg_mode: str = "token-mean", *, cliprange_value: float = 0.2,
                  loss_scale_factor: Optional[int] = None):
    """verl's ``value_loss`` bound to a critic config the way verl's trainer binds it
    (``partial(value_loss, config=critic_config)``)."""
    from verl.workers.config import FSDPCriticConfig
    from verl.workers.utils.losses import value_loss

    cfg = FSDPCriticConfig(strategy="fsdp2", rollout_n=1, ppo_micro_batch_size_per_gpu=2, ppo_mini_batch_size=8,
                           use_dynamic_bsz=False, cliprange_value=cliprange_value, loss_agg_mode=loss_agg_mode,
                           loss_scale_factor=loss_scale_factor)
    return partial(value_loss, config=cfg)


def value_step_errors(ref: list, got: list, batches) -> list:
    """:func:`run_steps` results of two critics (``loss_function`` = :func:`value_loss_fn`), per step: the values'
    max abs difference at the positions verl reads (``values``) and the reference's largest value
    (``values_scale``), ``loss`` and ``grad_norm`` pairs, the global gradient relative error ``grad_rel`` and
    ``got``'s ``zorro/fallback_batches`` of both passes. Plain floats."""
    from zorro_verl.testing import grad_rel_error

    errs = []
    for a, b, td in zip(ref, got, batches):
        mask = td["response_mask"].bool()
        va, vb = (response_values(x["inf"]["model_output"]["values"], td) for x in (a, b))
        e = {"values": (va - vb)[mask].abs().max().item(), "values_scale": va[mask].abs().max().item()}
        e["loss"] = (sum(a["tr"]["loss"]), sum(b["tr"]["loss"]))
        norms = [x["tr"]["metrics"].get("grad_norm") for x in (a, b)]
        e["grad_norm"] = None if None in norms else tuple(float(n) for n in norms)
        e["grad_rel"] = grad_rel_error(a["grads"], b["grads"])
        e["fallback"] = [m.get("zorro/fallback_batches", [0.0])[0] for m in (b["inf"]["metrics"], b["tr"]["metrics"])]
        errs.append(e)
    return errs


def assert_value_steps_match(errs: list, atol: float, rtol: float) -> None:
    """:func:`value_step_errors` within the fp32 engine tolerances: values max abs <= ``atol`` (on values that are not
    trivially small), value loss, grad norm and gradients relative <= ``rtol`` at every step, no stock fallback."""
    for k, e in enumerate(errs):
        assert e["values_scale"] > 0.1 and e["values"] <= atol, (k, e)
        la, lb = e["loss"]
        assert abs(la) > 1e-4 and abs(la - lb) <= rtol * abs(la), (k, e)
        if e["grad_norm"] is not None:
            ga, gb = e["grad_norm"]
            assert ga > 1e-5 and abs(ga - gb) <= rtol * ga, (k, e)
        assert e["grad_rel"] <= rtol, (k, e)
        assert e["fallback"] == [0.0, 0.0], (k, e)


def lora_adapter(ckpt: str, out, target_modules="all-linear", *, rank: int = 8, alpha: int = 16,
                 dropout: float = 0.0, seed: int = 0) -> str:
    """A LoRA adapter of the checkpoint ``ckpt`` (:func:`tests.support.lora.wrap_lora`: ``lora_B`` drawn at
    random) saved under ``out``, as verl's ``model.lora_adapter_path`` loads it (a vision-language checkpoint is
    loaded as ``AutoModelForImageTextToText``, as verl loads it). Returns the directory."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from tests.support.lora import wrap_lora

    vlm = hasattr(AutoConfig.from_pretrained(ckpt), "vision_config")
    model = (AutoModelForImageTextToText if vlm else AutoModelForCausalLM).from_pretrained(ckpt, dtype=torch.float32)
    wrap_lora(model, target_modules, rank=rank, alpha=alpha, dropout=dropout, seed=seed).save_pretrained(str(out))
    return str(out)


def lora_model(adapter: Optional[str] = None, target_modules="all-linear", *, rank: int = 8,
               alpha: int = 16) -> dict:
    """``model_overrides`` of a LoRA run (verl's ``HFModelConfig`` keys): a fresh adapter of ``rank`` / ``alpha`` on
    ``target_modules``, or the saved ``adapter`` (:func:`lora_adapter`) when given."""
    out = {"lora_rank": rank, "lora_alpha": alpha, "target_modules": target_modules}
    if adapter is not None:
        out["lora_adapter_path"] = adapter
    return out


def head_unit_policy(ckpt: str) -> dict:
    """``engine_overrides`` that make FSDP1 wrap the (untied) LM head as its own unit, as FSDP2 does: verl's
    size-based wrap policy (``wrap_policy.min_num_params``) at the head's parameter count (the embeddings and the
    larger blocks become units too)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(ckpt)
    return {"wrap_policy": {"min_num_params": cfg.vocab_size * cfg.hidden_size}}


def make_engine_batch(*, batch_size: int = 8, num_prompts: int = 3, prompt_len: int = 6, response_len: int = 5,
                      vocab: int = 128, seed: int = 0, shuffle: bool = True, temperature: float = 1.0,
                      calculate_entropy: bool = True, use_dynamic_bsz: bool = False, micro_batch_size: int = 2,
                      max_token_len: int = 64, use_remove_padding: bool = True, global_batch_size=None,
                      base: Optional[dict] = None):
    """A jagged verl batch (TensorDict) with training fields, built like verl's trainer does; ``base``: a padded
    batch with training fields to use instead of a dummy GRPO batch (e.g. ``zorro_verl.testing.batch_from_rows``)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    from zorro_verl.testing import create_dummy_batch

    if base is None:
        b = create_dummy_batch(batch_size=batch_size, num_unique_prompts=num_prompts, prompt_len=prompt_len,
                               response_len=response_len, device="cpu", include_training_fields=True,
                               add_padding=True, vocab_size=vocab, seed=seed, shuffle=shuffle)
        P = prompt_len
    else:
        b, P = base, base["input_ids"].shape[1] - base["responses"].shape[1]
        batch_size = b["input_ids"].shape[0]
    fields = dict(b)
    fields["prompts"] = b["input_ids"][:, :P]
    td = tu.get_tensordict(fields)
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(td, temperature=temperature, calculate_entropy=calculate_entropy,
                         use_dynamic_bsz=use_dynamic_bsz, micro_batch_size_per_gpu=micro_batch_size,
                         max_token_len_per_gpu=max_token_len, use_remove_padding=use_remove_padding,
                         global_batch_size=global_batch_size if global_batch_size is not None else batch_size,
                         use_fused_kernels=False)
    return td


def ppo_loss_fn(loss_agg_mode: str = "token-mean", *, use_kl_loss: bool = False, kl_loss_type: str = "low_var_kl",
                kl_loss_coef: float = 0.001, entropy_coeff: float = 0.0, loss_scale_factor: Optional[int] = None,
                policy_loss: Optional[dict] = None):
    """verl's ``ppo_loss`` bound to a minimal actor config the way verl's worker binds it
    (``partial(ppo_loss, config=actor_config)``). Defaults: vanilla clip loss, no KL / entropy terms;
    ``policy_loss`` holds ``PolicyLossConfig`` keys (``loss_mode``, ``kl_cov_ratio``...)."""
    from verl.workers.config import FSDPActorConfig
    from verl.workers.config.actor import PolicyLossConfig
    from verl.workers.utils.losses import ppo_loss

    cfg = FSDPActorConfig(strategy="fsdp2", rollout_n=1, ppo_micro_batch_size_per_gpu=2, ppo_mini_batch_size=8,
                          use_dynamic_bsz=False, loss_agg_mode=loss_agg_mode, use_kl_loss=use_kl_loss,
                          kl_loss_type=kl_loss_type, kl_loss_coef=kl_loss_coef, entropy_coeff=entropy_coeff,
                          loss_scale_factor=loss_scale_factor, policy_loss=PolicyLossConfig(**(policy_loss or {})))
    return partial(ppo_loss, config=cfg)


def sft_batch(samples, *, dynamic: bool, micro: int = 3, max_tok: int = 80):
    """The TensorDict verl's SFT trainer hands ``TrainingWorker.train_batch`` (``fit``: the collated batch, its
    ``meta_info``, ``global_token_num``, and the worker's default keys)."""
    from tensordict.tensorclass import NonTensorData
    from verl.utils import tensordict_utils as tu
    from verl.utils.dataset.dataset_utils import DatasetPadMode, SFTTensorCollator

    data = SFTTensorCollator(DatasetPadMode.NO_PADDING)(samples)
    meta = {"use_remove_padding": True, "use_dynamic_bsz": dynamic, "max_token_len_per_gpu": max_tok,
            "micro_batch_size_per_gpu": micro, "temperature": 1.0, "global_batch_size": len(samples),
            "pad_mode": DatasetPadMode.NO_PADDING, "pad_token_id": 0}
    td = tu.get_tensordict(tensor_dict=data, non_tensor_dict=meta)
    seqlens = td["input_ids"].offsets().diff().tolist()
    tu.assign_non_tensor(td, update_lr_scheduler=True, global_token_num=NonTensorData(seqlens),
                         use_fused_kernels=False, return_model_output=True)
    return td


def sft_loss_fn():
    from verl.workers.utils.losses import sft_loss

    return partial(sft_loss, config=None)  # as verl's SFT trainer binds it


def infer(engine, td):
    """The engine's inference pass (old log-prob / ref) on a copy of ``td``."""
    with engine.eval_mode():
        return engine.infer_batch(td.clone(), loss_function=None)


def output_values(out, td, key: str) -> torch.Tensor:
    """``[B, Rmax]`` values of ``out["model_output"][key]`` (zeros on pads)."""
    return response_values(out["model_output"][key], td)


def response_values(nested: torch.Tensor, td) -> torch.Tensor:
    """verl's own slicing of a nested predict-next output to ``[B, Rmax]`` (zeros on pads)."""
    from verl.workers.utils.padding import no_padding_2_padding

    return no_padding_2_padding(nested, td)


def engine_grads(engine) -> dict:
    """Full (unsharded) gradients after ``train_batch`` (clipped as the optimizer saw them), by parameter name
    (``model.layers.0.mlp.up_proj.weight``...) under FSDP2 and FSDP1. Under FSDP1 a collective: every rank calls it."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if isinstance(engine.module, FullyShardedDataParallel):
        return _fsdp1_grads(engine.module)
    out = {}
    for name, p in engine.module.named_parameters():
        if p.grad is not None:
            g = p.grad
            out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out


def _fsdp1_grads(root) -> dict:
    """Per-parameter full gradients of an FSDP1 model (``use_orig_params=False``: the optimizer sees one flat
    parameter per FSDP unit, sharded over the unit's ranks): each unit's flat gradient is all-gathered, its padding
    dropped and the rest cut into the original parameters (names without FSDP's wrapper prefixes)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel

    out = {}
    for prefix, unit in root.named_modules():
        if not isinstance(unit, FullyShardedDataParallel) or unit._handle is None:
            continue
        flat = unit._handle.flat_param
        grad = flat.grad if flat.grad is not None else torch.zeros_like(flat)  # [sharded numel] (1-D)
        if unit._handle.uses_sharded_strategy and unit.world_size > 1:
            parts = [torch.empty_like(grad) for _ in range(unit.world_size)]
            dist.all_gather(parts, grad.contiguous(), group=unit.process_group)
            grad = torch.cat(parts)
        grad = grad[: sum(flat._numels_with_padding)]
        prefix = prefix.replace("_fsdp_wrapped_module.", "").replace("_fsdp_wrapped_module", "")
        names, shapes = iter(flat._fqns), iter(flat._shapes)
        for piece, padding in zip(torch.split(grad, flat._numels_with_padding), flat._is_padding_mask):
            if not padding:
                out[(prefix + "." if prefix else "") + next(names)] = piece.view(next(shapes)).detach().clone()
    return out


def run_steps(engine, batches, loss_function=None) -> list:
    """Per batch in order: the inference pass, then one training step (``train_batch``: forward, backward, clipping,
    optimizer step) with ``loss_function`` (default :func:`ppo_loss_fn`). So batch ``k``'s inference runs on the
    weights after ``k`` optimizer steps. Returns per batch ``{"inf", "tr", "grads"}`` (grads: :func:`engine_grads`,
    the step's clipped gradients)."""
    loss_function = loss_function or ppo_loss_fn()
    out = []
    for td in batches:
        with engine.eval_mode():
            inf = engine.infer_batch(td.clone(), loss_function=None)
        with engine.train_mode(zero_grad_on_exit=False):  # keep the grads for the comparison
            tr = engine.train_batch(td.clone(), loss_function=loss_function)
        out.append({"inf": inf, "tr": tr, "grads": engine_grads(engine)})
    return out


def step_errors(ref: list, got: list, batches) -> list:
    """Errors of :func:`run_steps` results ``got`` against ``ref`` (same batches), per step: log-prob / entropy max
    abs over valid response tokens (``log_probs``, ``entropy``; entropy None when not computed) and the reference's
    largest log-prob magnitude (``log_probs_scale``), ``loss`` and ``grad_norm`` pairs (ref, got; grad norm None on
    ranks verl reports none), the global gradient relative error ``grad_rel`` and ``got``'s
    ``zorro/fallback_batches`` of both passes (``fallback``). Plain floats (JSON for the rank processes)."""
    from zorro_verl.testing import grad_rel_error

    errs = []
    for a, b, td in zip(ref, got, batches):
        mask = td["response_mask"].bool()
        e = {}
        for key in ("log_probs", "entropy"):
            if key not in b["inf"]["model_output"]:
                e[key] = None
                continue
            va, vb = (response_values(x["inf"]["model_output"][key], td) for x in (a, b))
            e[key] = (va - vb)[mask].abs().max().item()
            if key == "log_probs":
                e["log_probs_scale"] = va[mask].abs().max().item()
        e["loss"] = (sum(a["tr"]["loss"]), sum(b["tr"]["loss"]))
        norms = [x["tr"]["metrics"].get("grad_norm") for x in (a, b)]
        e["grad_norm"] = None if None in norms else tuple(float(n) for n in norms)
        e["grad_rel"] = grad_rel_error(a["grads"], b["grads"])
        e["fallback"] = [m.get("zorro/fallback_batches", [0.0])[0] for m in (b["inf"]["metrics"], b["tr"]["metrics"])]
        errs.append(e)
    return errs


def assert_steps_match(errs: list, atol: float, rtol: float, *, zorro: bool = True) -> None:
    """:func:`step_errors` within the fp32 engine tolerances: log-probs / entropy max abs <= ``atol`` (on log-probs
    that are not trivially small), loss, grad norm and gradients relative <= ``rtol`` at every step (and, for a zorro
    run, no stock fallback)."""
    for k, e in enumerate(errs):
        assert e["log_probs_scale"] > 0.1 and e["log_probs"] <= atol, (k, e)
        assert e["entropy"] is None or e["entropy"] <= atol, (k, e)
        la, lb = e["loss"]
        assert abs(la) > 1e-4 and abs(la - lb) <= rtol * abs(la), (k, e)
        if e["grad_norm"] is not None:
            ga, gb = e["grad_norm"]
            assert ga > 1e-5 and abs(ga - gb) <= rtol * ga, (k, e)
        assert e["grad_rel"] <= rtol, (k, e)
        if zorro:
            assert e["fallback"] == [0.0, 0.0], (k, e)


def padded_stock_vs_zorro(ckpt: str, *, attn_implementation: str = "sdpa", strategy: str = "fsdp2",
                          zorro_settings: Optional[dict] = None) -> dict:
    """The stock engine run padded (``use_remove_padding=False``) vs the zorro engine (``True``) on one 8-row,
    2-prompt batch of ragged, shuffled rows: inference (log-probs, entropy at temperature 0.8) and one training step
    (verl's PPO loss, micro-batches of 4), under ``strategy``. For models whose CPU stock remove-padding path is not
    a reference (a packed row that CPU attention / delta-net kernels cannot separate). ``zorro_settings``: the zorro
    engine's settings (default: the ``sdpa`` backend).

    Returns the max abs log-prob / entropy differences over valid response tokens (``log_probs``, ``entropy``),
    the stock values' max magnitudes (``log_probs_scale``, ``entropy_scale``), ``loss`` and ``grad_norm`` pairs
    (stock, zorro), the gradient relative error ``grad_rel``, the zorro ``dedup_ratio`` and the zorro grads' names.
    """
    from zorro_verl.testing import grad_rel_error

    batches = [make_engine_batch(batch_size=8, num_prompts=2, prompt_len=9, response_len=5, seed=5, shuffle=True,
                                 temperature=0.8, calculate_entropy=True, micro_batch_size=4, use_remove_padding=z)
               for z in (False, True)]
    mask = batches[1]["response_mask"].bool()  # the same in both batches
    infer_out, train, grads = [], [], []
    for z, td in zip((False, True), batches):
        eng = build_engine(ckpt, zorro=z, micro_batch_size=4, use_remove_padding=z,
                           attn_implementation=attn_implementation, strategy=strategy,
                           zorro_settings=zorro_settings if z else None)
        with eng.eval_mode():
            infer_out.append(eng.infer_batch(td.clone(), loss_function=None))
        with eng.train_mode(zero_grad_on_exit=False):  # keep the grads for the comparison
            train.append(eng.train_batch(td.clone(), loss_function=ppo_loss_fn()))
        grads.append(engine_grads(eng))
    res = {}
    for key in ("log_probs", "entropy"):
        a, b = (response_values(o["model_output"][key], t) for o, t in zip(infer_out, batches))
        res[key] = (a - b)[mask].abs().max().item()
        res[f"{key}_scale"] = a[mask].abs().max().item()
    res["loss"] = (sum(train[0]["loss"]), sum(train[1]["loss"]))
    res["grad_norm"] = (float(train[0]["metrics"]["grad_norm"]), float(train[1]["metrics"]["grad_norm"]))
    res["grad_rel"] = grad_rel_error(grads[0], grads[1])
    res["dedup_ratio"] = infer_out[1]["metrics"]["zorro/dedup_ratio"][0]
    res["grad_names"] = sorted(grads[1])
    return res


def assert_matches_stock(r: dict, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    """The fp32 engine tolerances on a :func:`padded_stock_vs_zorro` result: log-probs / entropy max abs <= atol
    (on values that are not trivially small), loss, grad norm and gradients relative <= rtol, zorro deduplicated."""
    for key in ("log_probs", "entropy"):
        assert r[f"{key}_scale"] > 0.1 and r[key] <= atol, (key, r[key])
    assert r["dedup_ratio"] > 1.0
    (loss_a, loss_b), (gn_a, gn_b) = r["loss"], r["grad_norm"]
    assert abs(loss_a) > 1e-4 and gn_a > 1e-4
    assert abs(loss_a - loss_b) <= rtol * abs(loss_a)
    assert abs(gn_a - gn_b) <= rtol * gn_a
    assert r["grad_rel"] <= rtol


def rank_batches(rank: int, use_dynamic_bsz: bool):
    """Per-DP-rank data for the 2-rank tests: rank 0 has four 2-row groups, rank 1 groups of 3, 3 and 2, so with a
    micro-batch size of 4 rank 0 needs 2 micro-batches and rank 1 needs 3 (the engine must agree on 3)."""
    if rank == 0:
        return make_engine_batch(batch_size=8, num_prompts=4, prompt_len=7, response_len=5, seed=21, shuffle=True,
                                 temperature=0.8, use_dynamic_bsz=use_dynamic_bsz, micro_batch_size=4,
                                 max_token_len=40, global_batch_size=16)
    return make_engine_batch(batch_size=8, num_prompts=3, prompt_len=7, response_len=5, seed=22, shuffle=True,
                             temperature=0.8, use_dynamic_bsz=use_dynamic_bsz, micro_batch_size=4, max_token_len=40,
                             global_batch_size=16)


def ray_engine_worker_class():
    """A verl ``Worker`` (built lazily: verl must be importable) that compares the two engines on its DP shard."""
    from verl.single_controller.base import Worker
    from verl.single_controller.base.decorator import Dispatch, register

    class ZorroEngineTestWorker(Worker):
        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def compare(self, ckpt: str, use_dynamic_bsz: bool) -> dict:
            import importlib.metadata as md
            import os

            import torch.distributed as dist
            from verl.workers.engine import EngineRegistry

            from zorro_verl.integrations.verl.v09.engine import ZorroFSDPEngineWithLMHead
            from zorro_verl.packing.microbatch import fixed_size_microbatches
            from zorro_verl.testing import grad_rel_error

            has_ep = any(ep.name == "zorro_verl" for ep in md.entry_points(group="verl.plugins"))
            # the entry point, loaded by `import verl` in this Ray worker, registered the engine when
            # verl.workers.engine was imported (the CPU platform came first: VERL_USE_EXTERNAL_MODULES)
            registered_by_plugin = EngineRegistry._engines["language_model"]["fsdp2"].get("cpu") \
                is ZorroFSDPEngineWithLMHead
            if not dist.is_initialized():
                dist.init_process_group(backend="gloo", rank=int(os.environ["RANK"]),
                                        world_size=int(os.environ["WORLD_SIZE"]))
            rank = dist.get_rank()
            td = rank_batches(rank, use_dynamic_bsz)
            res = {"rank": rank, "has_entry_point": has_ep, "registered_by_plugin": registered_by_plugin}
            from zorro_verl.integrations.verl.v09.batching import row_group_ids, row_lengths

            p, r = row_lengths(td)
            res["local_fixed_count"] = len(fixed_size_microbatches(row_group_ids(td, p), p, r, 4))
            outs = {}
            for z in (False, True):
                eng = build_engine(ckpt, zorro=z, use_dynamic_bsz=use_dynamic_bsz, micro_batch_size=4,
                                   max_token_len=40)
                with eng.eval_mode():
                    inf = eng.infer_batch(td.clone(), loss_function=None)
                with eng.train_mode(zero_grad_on_exit=False):  # keep the grads for the comparison
                    tr = eng.train_batch(td.clone(), loss_function=ppo_loss_fn())
                outs[z] = (inf, tr, engine_grads(eng))
                if z:
                    res["zorro_count"] = len(eng.zorro_last_micro_batches)
                    res["zorro_metrics"] = {k: v for k, v in inf["metrics"].items() if k.startswith("zorro/")}
            mask = td["response_mask"].bool()
            (ia, ta, sa), (ib, tb, sb) = outs[False], outs[True]
            res["logp_max_abs"] = (response_values(ia["model_output"]["log_probs"], td)
                                   - response_values(ib["model_output"]["log_probs"], td))[mask].abs().max().item()
            res["entropy_max_abs"] = (response_values(ia["model_output"]["entropy"], td)
                                      - response_values(ib["model_output"]["entropy"], td))[mask].abs().max().item()
            res["loss"] = (sum(ta["loss"]), sum(tb["loss"]))
            res["grad_norm"] = (float(ta["metrics"]["grad_norm"]), float(tb["metrics"]["grad_norm"]))
            res["grad_rel"] = grad_rel_error(sa, sb)
            return res

    return ZorroEngineTestWorker
