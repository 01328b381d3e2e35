"""megatron-core 0.19 on a CPU-only torch, for the Megatron tests (never shipped; see
docs/design/megatron.md "Megatron on the CPU" for why each shim exists): process-group setup, the CPU shims, a tiny fp64
``GPTModel`` on megatron's local (non-Transformer-Engine) layer spec, a verl-style batch and the stock reference.

The reference is megatron's ordinary forward with **no project code**: the right-padded rows ``[prompt | response |
pad]`` as one ``[B, L]`` batch, megatron's own ``DotProductAttention`` with a causal mask (right padding cannot reach
an earlier token), and log-probs / entropy by ``torch.log_softmax`` in fp64.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

__all__ = ["init_megatron", "build_gpt", "make_batch", "stock_outputs", "zorro_outputs", "grads", "compare",
           "VOCAB", "LOSS_ENT_WEIGHT", "CudaAsCpu", "cuda_as_cpu", "fp64_moe_routing"]

VOCAB = 96
#: loss = sum(w * log_probs) + LOSS_ENT_WEIGHT * sum(entropy): every gradient path (log-probs and entropy) is used
LOSS_ENT_WEIGHT = 0.1

_SHIMMED = False
#: :func:`build_gpt`'s MoE layers: 4 experts, top-2 softmax routing in fp64, no statistic over the batch's tokens
_MOE = {"num_moe_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32, "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0, "moe_token_dispatcher_type": "allgather", "moe_router_dtype": "fp64"}
#: activation recomputation settings of :func:`build_gpt`: whole layers, or megatron's selective core attention
#: :func:`build_gpt`'s MLA layers (DeepSeek-V3 shaped, tiny): q / k heads of 16 + 8 (decoupled RoPE part), v heads of
#: 12 (!= 24), compressed queries and keys / values; ``rope_type`` and ``q_lora_rank`` come from the call
_MLA = {"multi_latent_attention": True, "kv_lora_rank": 20, "qk_head_dim": 16, "qk_pos_emb_head_dim": 8,
        "v_head_dim": 12, "kv_channels": 12, "rotary_base": 10000, "rotary_scaling_factor": 4.0,
        "original_max_position_embeddings": 16, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32,
        "beta_slow": 1}
_RECOMPUTE = {None: {}, "full": {"recompute_granularity": "full", "recompute_method": "uniform",
                                 "recompute_num_layers": 1},
              "core_attn": {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}}


def _cpu_shims(sequence_parallel_norms: bool) -> None:
    """P1: megatron asks ``torch.cuda.current_device()`` for device arguments; P2: its RNG tracker reads CUDA
    generator states (dropout is 0 here, so the inference tracker's no-op ``fork`` is right), P7 the same around
    activation recomputation; P3 (sequence
    parallelism): the local spec's torch norms refuse SP, so build the same norm and mark its parameters
    ``sequence_parallel`` as Transformer Engine's norms are (their gradients are then summed over TP)."""
    global _SHIMMED
    if _SHIMMED:
        return
    torch.cuda.current_device = lambda: torch.device("cpu")
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    # P7 (activation recomputation): megatron's checkpoint saves / restores the CUDA generator's state around the
    # recomputed forward; there is none (the CPU generator's state is still saved and restored)
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: None
    mrandom._set_cuda_rng_state = lambda *args, **kwargs: None
    if sequence_parallel_norms:
        from megatron.core.transformer import torch_norm

        def new(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False, zero_centered_gamma=False,
                normalization="LayerNorm"):
            norm = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}[config.normalization](
                normalized_shape=hidden_size, eps=eps)
            for p in norm.parameters():
                p.sequence_parallel = bool(config.sequence_parallel)
            return norm

        torch_norm.WrappedTorchNorm.__new__ = new
    _SHIMMED = True


class _Fp64RouterTorch:
    """``torch`` as megatron's MoE routing module sees it (P8, fp64 tests of MoE models): its score softmax is
    hard-wired to ``dtype=torch.float32`` ("all the intermediate calculations are in fp32"), so an fp64 model's router
    probabilities are fp32-rounded and any reassociation of their gradients (deduplicated prompt tokens) shows at
    fp32 level. Here a softmax of fp64 input stays fp64; everything else is ``torch``."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def softmax(x, dim=None, dtype=None, **kwargs):
        if x.dtype == torch.float64:
            dtype = None
        return torch.softmax(x, dim=dim, dtype=dtype, **kwargs)


def fp64_moe_routing() -> None:
    """Install :class:`_Fp64RouterTorch` in megatron's ``moe_utils`` (idempotent; test processes only)."""
    from megatron.core.transformer.moe import moe_utils

    if not isinstance(moe_utils.torch, _Fp64RouterTorch):
        moe_utils.torch = _Fp64RouterTorch()


_MLA_DPA = None


def mla_dot_product_attention() -> type:
    """P9 (MLA on the local spec): ``MLASelfAttention`` builds its core attention with ``k_channels`` /
    ``v_channels`` (TE's attention takes them), which megatron's local ``DotProductAttention`` does not accept. Its
    math already handles q / k heads wider than v heads (scores from q·k, the context sized by ``kv_channels``, set
    to ``v_head_dim``), so this subclass only takes the two arguments and checks them. Cached: one class."""
    global _MLA_DPA
    if _MLA_DPA is None:
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        class MLADotProductAttention(DotProductAttention):
            def __init__(self, config, *args, k_channels=None, v_channels=None, **kwargs):
                assert v_channels in (None, config.kv_channels), (v_channels, config.kv_channels)
                super().__init__(config, *args, **kwargs)

        _MLA_DPA = MLADotProductAttention
    return _MLA_DPA


def with_mla_core_attention(block, config):
    """P9 in a decoder block spec (``TransformerBlockSubmodules``) built for the local modules: each multi-latent
    attention layer's core attention is :func:`mla_dot_product_attention`. Other blocks are returned unchanged."""
    import dataclasses

    if not getattr(config, "multi_latent_attention", False):
        return block
    specs = []
    for spec in block.layer_specs:
        att = spec.submodules.self_attention
        att = dataclasses.replace(att, submodules=dataclasses.replace(
            att.submodules, core_attention=mla_dot_product_attention()))
        specs.append(dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=att)))
    return dataclasses.replace(block, layer_specs=specs)


def _is_cuda(device) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, int) and not isinstance(device, bool)  # a bare ordinal means a CUDA device


class CudaAsCpu(torch.overrides.TorchFunctionMode):
    """P4, for megatron's pipeline schedule only: it creates ``torch.zeros(..., device="cuda")`` (token counts) and
    moves tensors with ``.cuda()``; inside this mode such device arguments mean the CPU (see :func:`cuda_as_cpu`)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if kwargs.get("device") is not None and _is_cuda(kwargs["device"]):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and not isinstance(args[1], (torch.Tensor, torch.dtype)) \
                and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


class _NoStream:
    """A CUDA stream / event stand-in whose methods do nothing (the CPU runs everything in order)."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        if name == "record_event":  # the MoE all-to-all dispatcher synchronizes on the event it records
            return lambda *args, **kwargs: _NoStream()
        return lambda *args, **kwargs: True if name == "query" else None


@contextlib.contextmanager
def cuda_as_cpu():
    """P4 + P5 for megatron's pipeline schedule: ``device="cuda"`` arguments mean the CPU (:class:`CudaAsCpu`) and
    ``torch.cuda.synchronize`` / streams / events (its p2p communication waits on them) do nothing; restored on
    exit."""
    names = {"synchronize": lambda *a, **k: None, "current_stream": _NoStream, "default_stream": _NoStream,
             "Stream": _NoStream, "Event": _NoStream, "stream": lambda *a, **k: contextlib.nullcontext(),
             "empty_cache": lambda *a, **k: None}
    saved = {n: getattr(torch.cuda, n) for n in names}
    for n, f in names.items():
        setattr(torch.cuda, n, f)
    try:
        with CudaAsCpu():
            yield
    finally:
        for n, f in saved.items():
            setattr(torch.cuda, n, f)


def init_megatron(rank: int, world: int, init_file: str, pipeline: int = 1, tensor: int | None = None,
                  expert: int = 1, context: int = 1) -> None:
    """gloo over a ``file://`` rendezvous, megatron's model-parallel groups (PP = ``pipeline``, TP = ``tensor``,
    by default the rest; EP = ``expert``, carved out of the data-parallel ranks; CP = ``context``), the CPU shims.
    Called again with other sizes it rebuilds the groups in the same process group."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    tensor = world // pipeline if tensor is None else tensor
    ps = parallel_state
    if ps.model_parallel_is_initialized() and (ps.get_pipeline_model_parallel_world_size(),
                                               ps.get_tensor_model_parallel_world_size(),
                                               ps.get_expert_model_parallel_world_size(),
                                               ps.get_context_parallel_world_size()) != (pipeline, tensor, expert,
                                                                                         context):
        parallel_state.destroy_model_parallel()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor,
                                                 pipeline_model_parallel_size=pipeline,
                                                 expert_model_parallel_size=expert,
                                                 context_parallel_size=context)
    _cpu_shims(sequence_parallel_norms=True)


def build_gpt(*, zorro: bool, sequence_parallel: bool = False, parallel_output: bool = True, seed: int = 0,
              pipeline: int = 1, recompute: str | None = None, moe: bool = False, moe_overrides: dict | None = None,
              config_hook=None, mla: bool = False, rope_type: str = "rope", q_lora_rank: int | None = 24,
              qk_layernorm: bool = True):
    """A tiny fp64 GPT (2 layers, hidden 64, 4 heads in 2 query groups (4 under MLA), RMSNorm, SwiGLU, RoPE, untied
    head) on the local spec; ``zorro``: the spec's core attention wrapped by :func:`zorro_layer_spec`. Built from
    ``seed`` with CPU initialisation, so every TP size shards the same master weights. ``pipeline``: the pipeline
    size of the model-parallel groups; the model is this rank's stage. ``recompute``: None, ``"full"`` (every layer
    recomputed in backward) or ``"core_attn"`` (megatron's selective recomputation of the core attention). ``moe``:
    every MLP a 4-expert top-2 MoE layer (local experts, all-gather dispatcher; call :func:`fp64_moe_routing`
    first); ``moe_overrides``: config fields over those MoE settings; ``config_hook(config)``: called on the built
    config before the model is (a setting megatron's config validation would refuse, set past it). ``mla``:
    megatron's multi-latent attention (``MLASelfAttention`` on the local spec, :data:`_MLA`) with ``rope_type``
    (``"rope"`` or ``"yarn"``), ``q_lora_rank`` (None: queries projected uncompressed) and ``qk_layernorm`` (the
    RMSNorms on the compressed q / kv)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.parallel_state import get_tensor_model_parallel_world_size
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    tp = get_tensor_model_parallel_world_size()
    # MLA keys have every query head (no GQA): num_query_groups = heads
    mla_kw = {**_MLA, "rope_type": rope_type, "q_lora_rank": q_lora_rank, "qk_layernorm": qk_layernorm} if mla else {}
    cfg = (MLATransformerConfig if mla else TransformerConfig)(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=4 if mla else 2, ffn_hidden_size=96,
        use_cpu_initialization=True, gradient_accumulation_fusion=False, params_dtype=torch.float64,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, masked_softmax_fusion=False, bias_activation_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        attention_softmax_in_fp32=False,  # True would round fp64 scores to fp32
        pipeline_dtype=torch.float64, tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel and tp > 1,
        context_parallel_size=parallel_state.get_context_parallel_world_size(),
        pipeline_model_parallel_size=pipeline, **_RECOMPUTE[recompute],
        **({**_MOE, **(moe_overrides or {})} if moe else {}), **mla_kw)
    if config_hook is not None:
        config_hook(cfg)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", **({"num_experts": _MOE["num_moe_experts"],
                                                                 "moe_grouped_gemm": False} if moe else {}),
                                    **({"multi_latent_attention": True, "qk_layernorm": qk_layernorm} if mla else {}))
    if mla:  # P9: the local core attention with MLA's extra constructor arguments
        import dataclasses

        att = spec.submodules.self_attention
        att = dataclasses.replace(att, submodules=dataclasses.replace(att.submodules,
                                                                      core_attention=mla_dot_product_attention()))
        spec = dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=att))
    if zorro:
        from zorro_verl.integrations.megatron import zorro_layer_spec

        spec = zorro_layer_spec(spec)
    torch.manual_seed(seed)
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=64,
                     position_embedding_type="rope", share_embeddings_and_output_weights=False,
                     parallel_output=parallel_output,
                     pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage())
    return model.to(torch.float64)  # torch norms are created in the default dtype


def make_batch(seed: int = 3, shared_prefix: bool = False):
    """A verl-style padded batch ``(input_ids [B, S], attention_mask [B, S], R)``: left-padded prompts, right-padded
    responses; two prompts whose rows interleave (groups ``0 1 0 1 0 1``), responses of 4, 0 (empty), 1, 3, 2 and 5
    tokens. ``shared_prefix``: the second prompt starts with the first one's 4 first tokens (a prefix tree case)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, VOCAB, (6,), generator=g), torch.randint(1, VOCAB, (4,), generator=g)]
    if shared_prefix:
        prompts[1] = torch.cat([prompts[0][:4], prompts[1][:3]])
    groups = [0, 1, 0, 1, 0, 1]
    rlens = [4, 0, 1, 3, 2, 5]
    Pw, R = max(len(p) for p in prompts), max(rlens)
    B = len(groups)
    ids = torch.zeros(B, Pw + R, dtype=torch.long)
    am = torch.zeros(B, Pw + R, dtype=torch.long)
    for b, (grp, r) in enumerate(zip(groups, rlens)):
        p = prompts[grp]
        ids[b, Pw - len(p):Pw] = p
        am[b, Pw - len(p):Pw] = 1
        ids[b, Pw:Pw + r] = torch.randint(1, VOCAB, (r,), generator=g)
        am[b, Pw:Pw + r] = 1
    return ids, am, R


def _rows(ids, am, R):
    """Valid tokens of each row, left-aligned ``[prompt | response]``, with the prompt / response lengths."""
    Pw = ids.shape[1] - R
    out = []
    for b in range(ids.shape[0]):
        p = int(am[b, :Pw].sum())
        r = int(am[b, Pw:].sum())
        out.append((torch.cat([ids[b, Pw - p:Pw], ids[b, Pw:Pw + r]]), p, r))
    return out


def loss_weights(n: int) -> torch.Tensor:
    """Fixed, unequal per-token loss weights ``[n]`` fp64 (response tokens in original row order)."""
    return torch.linspace(0.5, 1.5, n, dtype=torch.float64)


def stock_outputs(model, ids, am, R, tp_multiple: int = 1):
    """Megatron's ordinary forward: the rows right-padded to one ``[B, L]`` batch (``L`` a multiple of
    ``tp_multiple``, for sequence parallelism), megatron's ``DotProductAttention`` with a causal mask; log-probs /
    entropy of the response tokens by ``torch.log_softmax`` (fp64), backward of the test loss.
    Returns ``(log_probs [N], entropy [N])``, detached; gradients are left in ``model``."""
    rows = _rows(ids, am, R)
    L = max(len(t) for t, _, _ in rows)
    L = -(-L // tp_multiple) * tp_multiple
    batch = torch.zeros(len(rows), L, dtype=torch.long)
    for b, (t, _, _) in enumerate(rows):
        batch[b, :len(t)] = t
    mask = torch.triu(torch.ones(L, L, dtype=torch.bool), 1).view(1, 1, L, L)  # True = masked
    logits = model(input_ids=batch, position_ids=torch.arange(L)[None].expand(len(rows), L), attention_mask=mask)
    lps, ents = [], []
    for b, (t, p, r) in enumerate(rows):
        if r == 0:
            continue
        logp = torch.log_softmax(logits[b, p - 1:p + r - 1], -1)  # [r, V], row p-1+j predicts token p+j
        lps.append(logp.gather(-1, t[p:p + r, None])[:, 0])
        ents.append(-(logp.exp() * logp).sum(-1))
    lp, ent = torch.cat(lps), torch.cat(ents)
    ((lp * loss_weights(lp.numel())).sum() + LOSS_ENT_WEIGHT * ent.sum()).backward()
    return lp.detach(), ent.detach()


def zorro_outputs(model, ids, am, R, sharing: str = "prompt", backend: str = "sdpa"):
    """The zorro step on the same batch and the same test loss. Returns ``(log_probs [N], entropy [N], plan)``."""
    from zorro_verl.integrations.megatron import zorro_gpt_step
    from zorro_verl.packing import build_plan

    kw = {"min_shared_len": 1} if sharing == "prefix" else {}
    plan = build_plan(ids, am, R, sharing=sharing, **kw)
    lp, ent = zorro_gpt_step(model, plan, backend=backend, calculate_entropy=True)
    ((lp * loss_weights(lp.numel())).sum() + LOSS_ENT_WEIGHT * ent.sum()).backward()
    return lp.detach(), ent.detach(), plan


def grads(model) -> dict:
    """Every parameter's gradient (cloned); parameters marked ``sequence_parallel`` (norms under SP: each rank holds
    its sequence shard's part) summed over the TP group first, as megatron's ``finalize_model_grads`` does."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    out = {}
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name}: no gradient"
        g = p.grad.detach().clone()
        if getattr(p, "sequence_parallel", False) and parallel_state.get_tensor_model_parallel_world_size() > 1:
            dist.all_reduce(g, group=parallel_state.get_tensor_model_parallel_group())
        out[name] = g
    return out


def compare(stock: tuple, zorro: tuple, g_stock: dict, g_zorro: dict) -> dict:
    """Max abs log-prob / entropy differences and the max over parameters of ``max|dg| / max|g_stock|``."""
    assert g_stock.keys() == g_zorro.keys()
    rel = max(((g_zorro[n] - g_stock[n]).abs().max() / g_stock[n].abs().max().clamp_min(1e-300)).item()
              for n in g_stock)
    return {"logprob": (zorro[0] - stock[0]).abs().max().item(), "entropy": (zorro[1] - stock[1]).abs().max().item(),
            "grad_rel": rel, "n": int(stock[0].numel()), "params": len(g_stock)}
