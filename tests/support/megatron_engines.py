"""verl 0.9.1's Megatron engine on the CPU, for the zorro Megatron engine tests (never shipped; each patch is
explained in docs/design/megatron.md "Megatron on the CPU"; ids in brackets as in the code).

* CPU platform for verl [V1]; megatron-core shims [P1-P6, P9] (:mod:`tests.support.megatron_cpu` holds P1-P3);
* the model builders: Megatron-Bridge (verl's default; :mod:`tests.support.megatron_bridge_cpu`: import stubs and
  the local layer spec [S1, S2, S2a, B1, L1]) and vanilla mbridge on megatron-core 0.19 with the local
  (non-Transformer-Engine) spec [V4-V6]; :func:`build_engine`'s ``bridge`` picks one;
* fp32 engine configs [V2] (verl asserts bf16 / fp16), a pad id without a tokenizer [V7];
* the **stock reference** runs verl's padded path (``use_remove_padding=False``, bshd) with megatron's own
  ``DotProductAttention`` (its ``[B, S]`` valid mask turned into the 4-D causal mask megatron wants [V8]): no project
  code in it. The zorro engine runs verl's default ``use_remove_padding=True``; zorro packs its own row.

:func:`make_batch` builds a GRPO-style jagged batch the way verl's actor hands it to the engine
(``left_right_2_no_padding``), with interleaved siblings, an empty and a 1-token response.
"""

from __future__ import annotations

import enum
import os
import re
from functools import partial
from types import SimpleNamespace

import torch

from tests.support.megatron_cpu import CudaAsCpu

__all__ = ["setup_process", "start_rank", "save_tiny_checkpoint", "build_engine", "build_gpu_engine", "make_batch",
           "ppo_loss_fn", "gpt_of",
           "grads", "VOCAB"]

VOCAB = 128
_DONE = False


def setup_process(cpu_platform: bool = True) -> None:
    """Every patch, once per process, before verl's engine module is imported; ``cpu_platform=False`` leaves verl's
    platform to the caller (the end-to-end runs register their own, tests/support/verl_cpu_e2e.py)."""
    global _DONE
    if _DONE:
        return
    if cpu_platform:
        from tests.support import verl_cpu_platform

        verl_cpu_platform.use_cpu_platform()  # V1
    from tests.support import megatron_cpu

    megatron_cpu._cpu_shims(sequence_parallel_norms=True)  # P1-P3
    _CudaTypeNames().__enter__()  # P4 for the whole process: optimizers create device="cuda" tensors (+ P9)
    _fake_streams()  # P5
    _cpu_grad_clip()  # P6
    torch.nn.Module.cuda = lambda self, device=None: self  # mbridge's get_model moves the model .cuda()
    _mbridge_patches()  # V4-V6, V9
    from tests.support import megatron_bridge_cpu

    if megatron_bridge_cpu.AVAILABLE:
        megatron_bridge_cpu.install()  # S1, S2, S2a, B1, L1 (before verl imports megatron.bridge)
    _DONE = True


def start_rank(rank: int, world: int, init_file: str, ckpt: str, save=None) -> None:
    """A rank script's start: one thread, the patches (:func:`setup_process`), the gloo group (file rendezvous), and
    the checkpoint ``ckpt`` written once by rank 0 (``save(ckpt)``, default :func:`save_tiny_checkpoint`)."""
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    setup_process()
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    if rank == 0 and not os.path.exists(os.path.join(ckpt, "config.json")):
        (save or save_tiny_checkpoint)(ckpt)
    dist.barrier()


class _CudaTypeNames(CudaAsCpu):
    """P4, and P9: megatron's mixed-precision optimizer sorts parameters by ``param.type()`` names
    (``torch.cuda.BFloat16Tensor`` ...); a CPU tensor's name is given with ``cuda`` in it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        return super().__torch_function__(func, types, args, kwargs)


def _fake_streams() -> None:
    import contextlib

    from tests.support.megatron_cpu import _NoStream

    for name, f in {"current_stream": _NoStream, "default_stream": _NoStream, "Stream": _NoStream,
                    "Event": _NoStream, "stream": lambda *a, **k: contextlib.nullcontext(),
                    "synchronize": lambda *a, **k: None, "empty_cache": lambda *a, **k: None}.items():
        setattr(torch.cuda, name, f)


def _cpu_grad_clip() -> None:
    """P6: megatron's clipping asserts ``torch.cuda.FloatTensor`` grads; the same scaling on the CPU."""
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mopt

    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        attr = "decoupled_grad" if use_decoupled_grad else "grad"
        coeff = max_norm / (total_norm + 1.0e-6)
        if not isinstance(coeff, torch.Tensor) and coeff >= 1.0:
            return
        coeff = torch.as_tensor(coeff).clamp_max(1.0)
        for p in parameters:
            g = getattr(p, attr, None)
            if g is not None:
                g.detach().mul_(coeff)

    clip_grads.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    mopt.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32


def _mbridge_patches() -> None:
    import mbridge.core.util as mbu
    from mbridge.core import llm_bridge
    from mbridge.core.bridge import Bridge
    from mbridge.models.llama import LLaMABridge
    from mbridge.models.qwen2 import Qwen2Bridge
    from mbridge.models.qwen2moe import Qwen2MoEBridge
    from megatron.core.enums import ModelType
    from megatron.core.models.gpt import gpt_layer_specs

    class _Dummy(enum.Enum):
        encoder_and_decoder = 2

    # V4: mbridge 0.15.1 reads ModelType.encoder_and_decoder, gone in megatron-core 0.19
    mbu.ModelType = SimpleNamespace(encoder_or_decoder=ModelType.encoder_or_decoder,
                                    encoder_and_decoder=_Dummy.encoder_and_decoder)
    original = gpt_layer_specs.get_gpt_decoder_block_spec

    def local_block_spec(config, use_transformer_engine=True, vp_stage=None, **kw):  # V5: mbridge hardcodes TE
        # (vp_stage named: mbridge passes it, for virtual pipeline stages, only when the signature has it)
        return original(config, use_transformer_engine=False, vp_stage=vp_stage, **kw)

    llm_bridge.get_gpt_decoder_block_spec = local_block_spec
    # V6: the local spec's (unfused) norm names (Qwen3's bridge is Qwen2's subclass)
    for bridge in (Qwen2Bridge, LLaMABridge):
        bridge._OTHER_MAPPING = {**getattr(bridge, "_OTHER_MAPPING", {}),
                                 "input_layernorm.weight": ["model.layers.{layer_number}.input_layernorm.weight"]}
        bridge._MLP_MAPPING = {**bridge._MLP_MAPPING, "pre_mlp_layernorm.weight":
                               ["model.layers.{layer_number}.post_attention_layernorm.weight"]}
    # ... and the MoE bridges' (Qwen3-MoE's is Qwen2-MoE's subclass; their pre-MLP norm is mapped already)
    Qwen2MoEBridge._OTHER_MAPPING = {**Qwen2MoEBridge._OTHER_MAPPING,
                                     "input_layernorm.weight": ["model.layers.{layer_number}.input_layernorm.weight"]}
    # V9: the local spec's experts are SequentialMLP's ``mlp.experts.local_experts.{i}.linear_fc{1,2}.weight`` (TE's
    # grouped GEMM, which mbridge's MoE bridges name ``mlp.experts.linear_fc{1,2}.weight{i}``, needs a GPU): each local
    # name is given the grouped name of its global expert (EP rank offset), which the bridge's MoE mapping reads
    local_to_global = Bridge._weight_name_mapping_mcore_local_to_global

    def _local_to_global(self, model, consider_ep=True):
        names = local_to_global(self, model, consider_ep=consider_ep)
        per_rank = (self.config.num_moe_experts or 0) // max(self.mpu.ep_size, 1)
        offset = per_rank * self.mpu.ep_rank if consider_ep else 0
        for k, v in names.items():
            m = re.match(r"(.*\.mlp\.experts\.)local_experts\.(\d+)\.(linear_fc[12])\.weight$", v)
            if m:
                names[k] = f"{m.group(1)}{m.group(3)}.weight{int(m.group(2)) + offset}"
        return names

    Bridge._weight_name_mapping_mcore_local_to_global = _local_to_global


def save_tiny_checkpoint(path: str, family: str = "qwen3", layers: int = 2) -> str:
    """A tiny checkpoint of ``family`` (``qwen3``: q/k norms; ``qwen2``: q/k/v biases; ``llama``; ``qwen3_moe``:
    Qwen3-MoE, 4 experts, top-2) saved at ``path``
    from seed 0: ``layers`` layers (2), hidden 64, 4 heads in 2 KV groups, head dim 16, untied head, vocab
    :data:`VOCAB`."""
    import transformers

    cls_cfg, cls_model = {"qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                          "llama": ("LlamaConfig", "LlamaForCausalLM"),
                          "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM")}[family]
    kw = {"head_dim": 16} if family != "qwen2" else {}
    if family == "qwen3_moe":  # every layer a 4-expert top-2 MoE; the HF aux-loss coefficient as Qwen3-MoE ships it
        kw.update(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                  norm_topk_prob=True, mlp_only_layers=[], router_aux_loss_coef=0.001, output_router_logits=False)
    cfg = getattr(transformers, cls_cfg)(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=256, tie_word_embeddings=False, rms_norm_eps=1e-6,
                                         rope_theta=10000.0, **kw)
    cfg.architectures = [cls_model]
    torch.manual_seed(0)
    getattr(transformers, cls_model)(cfg).save_pretrained(path)
    return path


def _mask_hook(module, args, kwargs):
    """V8 (bshd only): verl hands the model a ``[B, S]`` valid mask (TE style); megatron's local attention wants the
    ``[B, 1, S, S]`` boolean mask (True = masked), built by verl's own helper."""
    from verl.models.mcore.util import _build_npu_attn_mask

    m = kwargs.get("attention_mask")
    if m is not None and m.dim() == 2:
        kwargs["attention_mask"] = _build_npu_attn_mask(m)
    return args, kwargs


def build_engine(ckpt: str, *, zorro: dict | None, tp: int = 1, pp: int = 1, remove_padding: bool = True,
                 micro_batch: int = 2, max_tokens: int = 48, engine_kwargs: dict | None = None,
                 model_kwargs: dict | None = None, dtype: str = "float32", transformer_overrides: dict | None = None,
                 bridge: str = "megatron-bridge", model_type: str = "language_model", engine_cls=None):
    """verl's Megatron LM engine for ``ckpt``, ``dtype`` (fp32 by default; ``bfloat16``: megatron's Float16Module),
    built through ``bridge`` (``megatron-bridge``: verl's default, ``vanilla_mbridge=False``; ``mbridge``: the
    legacy one), initialised: the class verl's ``EngineRegistry`` resolves for
    ``megatron`` (zorro's, which is the stock engine unless ``zorro`` enables it). ``zorro``: the zorro mapping (None:
    a stock ``McoreEngineConfig``); ``engine_kwargs`` / ``model_kwargs``: more engine / model config keys;
    ``transformer_overrides``: more ``override_transformer_config`` keys.
    ``model_type="value_model"``: the critic's engine (zorro's ``ZorroMegatronEngineWithValueHead``): the model's
    ``output_layer`` a fresh value head (verl's value-model hook). ``engine_cls``: build this class instead of the
    registry's (e.g. verl's own ``MegatronEngineWithValueHead`` as the stock reference).
    Megatron's model-parallel groups are rebuilt when ``tp`` / ``pp`` / the virtual pipeline, expert, expert
    tensor or context parallel size change."""
    from megatron.core import parallel_state as mpu
    from verl.trainer.config.config import CheckpointConfig
    from verl.workers.config import HFModelConfig, McoreEngineConfig, McoreOptimizerConfig
    from verl.workers.engine import EngineRegistry

    from tests.support.megatron_bridge_cpu import BRIDGES
    from zorro_verl.integrations.verl.v09.config import ZorroMcoreEngineConfig

    if bridge not in BRIDGES:
        raise ValueError(f"bridge: expected one of {sorted(BRIDGES)}, got {bridge!r}")
    # megatron's LanguageModule records its attention backend in NVTE_* variables at a build and asserts them at the
    # next one; Megatron-Bridge builds with AttnBackend.flash, mbridge with auto. A verl worker builds one kind; the
    # tests build both in one process
    for var in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
        os.environ.pop(var, None)
    vpp = (engine_kwargs or {}).get("virtual_pipeline_model_parallel_size")
    ep = (engine_kwargs or {}).get("expert_model_parallel_size", 1)
    etp = (engine_kwargs or {}).get("expert_tensor_parallel_size") or tp
    cp = (engine_kwargs or {}).get("context_parallel_size", 1)
    if mpu.model_parallel_is_initialized() and (mpu.get_tensor_model_parallel_world_size() != tp
                                                or mpu.get_pipeline_model_parallel_world_size() != pp
                                                or mpu.get_virtual_pipeline_model_parallel_world_size() != vpp
                                                or mpu.get_expert_model_parallel_world_size() != ep
                                                or mpu.get_expert_tensor_parallel_world_size() != etp
                                                or mpu.get_context_parallel_world_size() != cp):
        mpu.destroy_model_parallel()
    model_config = HFModelConfig(path=ckpt, load_tokenizer=False, use_remove_padding=remove_padding,
                                 model_type=model_type, **(model_kwargs or {}))
    object.__setattr__(model_config, "tokenizer", SimpleNamespace(pad_token_id=0))  # V7
    kw = dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=tp > 1,
              use_mbridge=True, vanilla_mbridge=BRIDGES[bridge], use_distributed_optimizer=False,
              use_remove_padding=remove_padding, micro_batch_size_per_gpu=micro_batch,
              infer_micro_batch_size_per_gpu=micro_batch, max_token_len_per_gpu=max_tokens,
              infer_max_token_len_per_gpu=max_tokens, seed=1,
              override_transformer_config={**dict(gradient_accumulation_fusion=False, masked_softmax_fusion=False,
                                               bias_activation_fusion=False, bias_dropout_fusion=False,
                                               apply_rope_fusion=False, persist_layer_norm=False,
                                               use_cpu_initialization=True,
                                               # Megatron-Bridge's providers turn on TE's fused cross-entropy
                                               **({"cross_entropy_loss_fusion": False}
                                                  if bridge == "megatron-bridge" else {})),
                                          # (a merge: the overrides may also name a key set above)
                                          **(transformer_overrides or {})})
    kw.update(engine_kwargs or {})  # (may replace a key set above: sequence_parallel)
    if zorro is None:
        engine_config = McoreEngineConfig(dtype="bfloat16", **kw)
    else:
        engine_config = ZorroMcoreEngineConfig(dtype="bfloat16", zorro=zorro, **kw)
    object.__setattr__(engine_config, "dtype", dtype)  # V2 (fp32: verl asserts bf16 / fp16)
    # SGD: the parameters after one step differ by lr x the gradients' difference (Adam's first step is ~lr x sign)
    optim = McoreOptimizerConfig(optimizer="sgd", lr=1e-3, total_training_steps=10, weight_decay=0.0, clip_grad=1.0)
    cls = engine_cls or EngineRegistry.get_engine_cls(model_type, "megatron")
    engine = cls(model_config=model_config, engine_config=engine_config, optimizer_config=optim,
                 checkpoint_config=CheckpointConfig())
    engine.initialize()
    if not remove_padding:
        from verl.utils.megatron_utils import unwrap_model

        for chunk in engine.module:  # every model chunk (virtual pipeline stages) gets verl's mask
            unwrap_model(chunk).register_forward_pre_hook(_mask_hook, with_kwargs=True)
    return engine


def build_gpu_engine(ckpt: str, *, zorro: dict | None, cp: int = 1, micro_batch: int = 2, max_tokens: int = 48,
                     transformer_overrides: dict | None = None, optimizer: dict | None = None):
    """verl's Megatron LM engine on this rank's GPU as verl builds it: Megatron-Bridge with its default Transformer
    Engine layer spec, bf16, TP = PP = 1, ``cp`` context-parallel ranks, verl's packed (THD) path; ``zorro`` the
    zorro mapping (None: a stock ``McoreEngineConfig``); ``optimizer``: ``McoreOptimizerConfig`` keys (default SGD at
    lr 1e-3, gradient clipping 1.0). No CPU patches: the GPU tests' and the GPU benchmark's builder."""
    from verl.trainer.config.config import CheckpointConfig
    from verl.workers.config import HFModelConfig, McoreEngineConfig, McoreOptimizerConfig
    from verl.workers.engine import EngineRegistry

    from zorro_verl.integrations.verl.v09.config import ZorroMcoreEngineConfig

    model_config = HFModelConfig(path=ckpt, load_tokenizer=False, use_remove_padding=True)
    object.__setattr__(model_config, "tokenizer", SimpleNamespace(pad_token_id=0))  # a checkpoint without one
    kw = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=cp,
              use_mbridge=True, vanilla_mbridge=False, use_distributed_optimizer=False, use_remove_padding=True,
              micro_batch_size_per_gpu=micro_batch, infer_micro_batch_size_per_gpu=micro_batch,
              max_token_len_per_gpu=max_tokens, infer_max_token_len_per_gpu=max_tokens, seed=1,
              override_transformer_config=dict(transformer_overrides or {}))
    cfg = (McoreEngineConfig(dtype="bfloat16", **kw) if zorro is None
           else ZorroMcoreEngineConfig(dtype="bfloat16", zorro=zorro, **kw))
    optim = McoreOptimizerConfig(**(optimizer or dict(optimizer="sgd", lr=1e-3, total_training_steps=10,
                                                       weight_decay=0.0, clip_grad=1.0)))
    for var in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):  # megatron asserts them per build
        os.environ.pop(var, None)
    engine = EngineRegistry.get_engine_cls("language_model", "megatron")(
        model_config=model_config, engine_config=cfg, optimizer_config=optim, checkpoint_config=CheckpointConfig())
    engine.initialize()
    return engine


def gpt_of(engine):
    from verl.utils.megatron_utils import unwrap_model

    return unwrap_model(engine.module[0])


def make_batch(*, dynamic: bool, seed: int = 0, rows: slice | None = None, temperature=1.0, max_tokens: int = 48,
               micro_batch: int = 2, shared_prefix: bool = False):
    """A jagged GRPO batch as verl's actor hands it to the engine: 3 prompts (lengths 7, 4, 6) x 4 rollouts, rows
    interleaved (groups ``0 1 2 0 1 2 ...``), responses of 1 to 6 tokens with one empty and two 1-token responses;
    ``rows``: a slice of the 12 rows (a data-parallel rank's share); ``shared_prefix``: prompts 2 and 3 start with
    prompt 1's first 3 tokens. Carries verl's non-tensor settings
    (``use_dynamic_bsz``, budgets, temperature, entropy)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g) for n in (7, 4, 6)]
    if shared_prefix:  # the three prompts start alike (a system prompt): a prefix tree of depth 2
        prompts = [prompts[0], torch.cat([prompts[0][:3], prompts[1]]), torch.cat([prompts[0][:3], prompts[2]])]
    rlens = [5, 0, 1, 6, 2, 3, 1, 4, 6, 2, 5, 3]
    groups = [i % 3 for i in range(12)]
    P, R = max(len(p) for p in prompts), max(rlens)
    B = len(rlens)
    ids = torch.zeros(B, P + R, dtype=torch.long)
    am = torch.zeros(B, P + R, dtype=torch.long)
    for b in range(B):
        p, r = prompts[groups[b]], rlens[b]
        ids[b, P - len(p):P] = p
        am[b, P - len(p):P] = 1
        ids[b, P:P + r] = torch.randint(1, VOCAB, (r,), generator=g)
        am[b, P:P + r] = 1
    sel = slice(None) if rows is None else rows
    ids, am = ids[sel], am[sel]
    B = ids.shape[0]
    pos = (am.cumsum(-1) - 1).clamp_min(0)
    fields = dict(input_ids=ids, attention_mask=am, position_ids=pos, prompts=ids[:, :P], responses=ids[:, P:],
                  response_mask=am[:, P:].float(),
                  old_log_probs=(torch.randn(12, R, generator=g) * 0.1 - 4)[sel],
                  advantages=torch.randn(12, R, generator=g)[sel], ref_log_prob=torch.zeros(B, R))
    if isinstance(temperature, torch.Tensor):
        fields["temperature"] = temperature[sel]
    td = left_right_2_no_padding(tu.get_tensordict(fields))
    extra = {} if isinstance(temperature, torch.Tensor) else {"temperature": float(temperature)}
    tu.assign_non_tensor(td, calculate_entropy=True, use_dynamic_bsz=dynamic, micro_batch_size_per_gpu=micro_batch,
                         max_token_len_per_gpu=max_tokens, global_batch_size=B, use_fused_kernels=False, **extra)
    return td


def ppo_loss_fn():
    """verl's ``ppo_loss`` bound to an actor config (token-mean), as the worker hands it to the engine."""
    from verl.workers.config import FSDPActorConfig
    from verl.workers.utils.losses import ppo_loss

    cfg = FSDPActorConfig(strategy="fsdp2", rollout_n=4, ppo_micro_batch_size_per_gpu=2, ppo_mini_batch_size=4,
                          use_dynamic_bsz=False, loss_agg_mode="token-mean")
    return partial(ppo_loss, config=cfg)


def grads(engine, trainable_only: bool = False) -> dict:
    """Each parameter's accumulated gradient after ``train_batch`` (DDP's ``main_grad``), cloned, by name
    (``trainable_only``: the parameters that train, e.g. LoRA adapters beside a frozen base)."""
    out = {}
    for name, p in gpt_of(engine).named_parameters():
        if trainable_only and not p.requires_grad:
            continue
        g = getattr(p, "main_grad", None)
        g = p.grad if g is None else g
        assert g is not None, f"{name}: no gradient"
        out[name] = g.detach().clone()
    return out


def grads_names(engine) -> list:
    """Names of the parameters that train (``requires_grad``)."""
    return [n for n, p in gpt_of(engine).named_parameters() if p.requires_grad]


def response_values(nested: torch.Tensor, td) -> torch.Tensor:
    """The response entries of a predict-next nested output ``[B, j]`` (row ``b``'s ``[p_b - 1, p_b + r_b - 1)``),
    concatenated: ``[N]``."""
    from zorro_verl.integrations.verl.v09.batching import row_lengths

    p, r = row_lengths(td)
    off = nested.offsets()
    vals = nested.values()
    return torch.cat([vals[off[b] + p[b] - 1: off[b] + p[b] - 1 + r[b]] for b in range(len(p))])


def env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))
