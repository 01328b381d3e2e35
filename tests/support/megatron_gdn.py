"""CPU stand-ins for megatron-core 0.19's gated delta-net (Qwen3.5 / Qwen3-Next hybrids) and for the Transformer Engine
block spec that Megatron-Bridge's Qwen3.5 provider builds them with (never shipped; docs/design/megatron.md "Megatron
on the CPU", ids in brackets as in the code).

* [G1] megatron's ``GatedDeltaNet`` refuses to build without flash-linear-attention (``HAVE_FLA``), whose kernels are
  Triton (GPU only): :func:`install_fla_standins` puts plain-torch functions with FLA's contracts in their place —
  :func:`causal_conv1d` (depthwise causal conv, per ``cu_seqlens`` segment), :func:`l2norm` and
  :func:`chunk_gated_delta_rule` (zorro's chunked reference, per segment with one initial state each). Unlike
  megatron's own ``torch_chunk_gated_delta_rule`` (fp32 only, no ``cu_seqlens``), they keep fp64 in fp64, so the
  model-level tests reach ~1e-12.
* [G2] the bridge's block spec (``get_transformer_block_with_experimental_attention_variant_spec``) asserts
  ``transformer_impl == "transformer_engine"`` and builds TE modules: :func:`cpu_hybrid_block_spec` is the same block
  (GDN / attention per ``linear_attention_freq``, the input norm fused into ``in_proj`` / ``linear_qkv`` / ``fc1`` as
  in TE, so the bridge's parameter names and mappings hold) on :class:`CpuSpecProvider`: megatron's local linears and
  ``DotProductAttention``, with :class:`CpuLayerNormColumnParallelLinear` for TE's ``LayerNormColumnParallelLinear``
  and :class:`CpuRMSNorm` (zero-centred gamma, as Qwen3.5 sets) for TE's norm.

* [G3] megatron's jit-fused (``torch.compile``) token-wise helpers of these layers run as plain methods, the ones that
  cast a gate / decay input with ``.float()`` keeping fp64 in fp64 (:func:`_compute_g_and_beta`; identical to
  megatron's for fp32 / bf16 models).

Both are checked against independent references in tests/integrations/megatron/test_gdn.py (the kernels against the
step-by-step delta rule and megatron's own fp32 torch kernel; the bridge-built model against transformers' Qwen3.5).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear

from zorro_verl.recurrent.packed import chunk_gated_delta_rule_ref

__all__ = ["causal_conv1d", "l2norm", "chunk_gated_delta_rule", "install_fla_standins", "CpuRMSNorm",
           "CpuLayerNormColumnParallelLinear", "CpuSpecProvider", "cpu_hybrid_block_spec"]


# ---------------------------------------------------------------------------------------------------- G1: kernels
def _segments(cu_seqlens, length: int) -> list:
    if cu_seqlens is None:
        return [(0, length)]
    cu = [int(c) for c in cu_seqlens.tolist()]
    return list(zip(cu[:-1], cu[1:]))


def causal_conv1d(x, weight=None, bias=None, residual=None, initial_state=None, output_final_state=False,
                  activation=None, cu_seqlens=None, **_):
    """FLA's ``causal_conv1d`` contract: ``x [b, s, d]``, ``weight [d, w]`` -> ``(y [b, s, d], None)``, each row (each
    ``cu_seqlens`` segment of a ``b = 1`` row) convolved causally from zeros, then ``activation`` (None / silu)."""
    if residual is not None or initial_state is not None or output_final_state:
        raise NotImplementedError("CPU causal_conv1d stand-in: residual / states are not used by megatron's GDN")
    d, w = weight.shape

    def one(seq):  # [s, d]
        y = F.conv1d(seq.t()[None], weight[:, None, :], bias, padding=w - 1, groups=d)[0, :, :seq.shape[0]].t()
        return F.silu(y) if activation in ("silu", "swish") else y

    if cu_seqlens is None:
        return torch.stack([one(x[b]) for b in range(x.shape[0])]), None
    return torch.cat([one(x[0, a:e]) for a, e in _segments(cu_seqlens, x.shape[1])])[None], None


def l2norm(x, eps: float = 1e-6, output_dtype=None):
    """FLA's ``l2norm``: ``x / sqrt(sum(x^2, -1) + eps)`` in ``x``'s dtype."""
    y = x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)
    return y if output_dtype is None else y.to(output_dtype)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, **_):
    """FLA's ``chunk_gated_delta_rule`` contract: ``q, k [b, s, H, Dk]``, ``v [b, s, H, Dv]``, ``g, beta [b, s, H]``,
    ``initial_state [b | segments, H, Dk, Dv]`` -> ``(o [b, s, H, Dv], final [b | segments, H, Dk, Dv] | None)``;
    with ``cu_seqlens`` (``b = 1``) every segment runs from its own initial state (zeros when None)."""
    if scale is not None and abs(scale - q.shape[-1] ** -0.5) > 1e-12:
        raise NotImplementedError("CPU chunk_gated_delta_rule stand-in: only the default scale 1/sqrt(Dk)")
    kw = dict(use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    if cu_seqlens is None:
        return chunk_gated_delta_rule_ref(q, k, v, g, beta, initial_state=initial_state,
                                          output_final_state=output_final_state, **kw)
    outs, finals = [], []
    for i, (a, e) in enumerate(_segments(cu_seqlens, q.shape[1])):
        h0 = None if initial_state is None else initial_state[i:i + 1]
        o, s = chunk_gated_delta_rule_ref(*(t[:, a:e] for t in (q, k, v, g, beta)), initial_state=h0,
                                          output_final_state=True, **kw)
        outs.append(o)
        finals.append(s)
    return torch.cat(outs, 1), (torch.cat(finals) if output_final_state else None)


def _at_least_fp32(x):
    return x if x.dtype == torch.float64 else x.float()


# G3: megatron's GDN / gated-attention helpers with ``.float()`` as "at least fp32" (identical for fp32 / bf16 models).
# In an fp64 model megatron's ``.float()`` rounds these inputs and, in backward, their gradients to fp32 per token;
# a deduplicated prompt token's gradient is the sum over its responses rounded once, the ordinary rows' each rounded
# then summed, so fp64 comparisons would see fp32-level differences (as P8 does for MoE routing).
def _compute_g_and_beta(self, A_log_local_cp, dt_bias_local_cp, alpha, beta):
    g = -A_log_local_cp.exp() * F.softplus(_at_least_fp32(alpha) + dt_bias_local_cp)
    return g, beta.sigmoid()


def _apply_gated_norm(self, x, gate):
    x_dtype = x.dtype
    y = self.out_norm(x.reshape(-1, x.shape[-1]))
    y = y * self.act_fn(_at_least_fp32(gate.reshape(-1, gate.shape[-1])))
    return y.to(x_dtype)


def _apply_output_gate(self, x, gate):
    x_dtype = x.dtype
    gate = gate.contiguous().view(*x.shape)
    return (x * torch.sigmoid(_at_least_fp32(gate))).to(x_dtype)


_FLA_DONE = False


def install_fla_standins() -> None:
    """G1, once per process: megatron's GDN modules see FLA as present, with the functions above as its kernels."""
    global _FLA_DONE
    if _FLA_DONE:
        return
    from megatron.core.ssm.gated_delta_net import common, gdn

    common.HAVE_FLA = True
    common.causal_conv1d, common.l2norm, common.chunk_gated_delta_rule = causal_conv1d, l2norm, chunk_gated_delta_rule
    gdn.causal_conv1d, gdn.chunk_gated_delta_rule = causal_conv1d, chunk_gated_delta_rule  # imported by name there
    from megatron.core.transformer.attention import Attention

    # G3: the token-wise helpers megatron compiles with jit_fuser (torch.compile: minutes on a CPU) as plain methods;
    # the three that cast a gate / decay input with .float() keep fp64 in fp64 (below), else they are megatron's
    fn = common._GDNBase.__dict__["_prepare_input_for_gated_delta_rule"]
    common._GDNBase._prepare_input_for_gated_delta_rule = getattr(fn, "_torchdynamo_orig_callable",
                                                                  getattr(fn, "__wrapped__", fn))
    common._GDNBase._compute_g_and_beta = _compute_g_and_beta
    common._GDNBase._apply_gated_norm = _apply_gated_norm
    Attention._apply_output_gate = _apply_output_gate
    _FLA_DONE = True


# ---------------------------------------------------------------------------------------------------- G2: block spec
class CpuRMSNorm(torch.nn.Module):
    """TE's RMSNorm on the CPU: ``x * rsqrt(mean(x^2) + eps) * (1 + w)`` with ``config.layernorm_zero_centered_gamma``
    (weights start at 0), ``* w`` otherwise (start at 1); in the input's dtype. ``[..., h]`` -> ``[..., h]``."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__()
        self.zero_centered = bool(getattr(config, "layernorm_zero_centered_gamma", False))
        self.eps = eps
        init = torch.zeros if self.zero_centered else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = bool(config.sequence_parallel)  # as TE's norms (summed over TP)

    def forward(self, x):
        w = 1 + self.weight if self.zero_centered else self.weight
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + self.eps) * w


class CpuLayerNormColumnParallelLinear(ColumnParallelLinear):
    """TE's ``LayerNormColumnParallelLinear`` on the CPU: megatron's ``ColumnParallelLinear`` (``weight``) after an
    RMSNorm whose weight is ``layer_norm_weight`` (:class:`CpuRMSNorm`'s rule): TE's parameter names, so the bridge's
    mappings (``in_proj.layer_norm_weight``, ``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``) load
    it unchanged. ``x [s(/tp under SP), b, h]`` -> ``(y [s, b, out/tp], bias | None)``."""

    def __init__(self, input_size, output_size, *, config, init_method, gather_output, bias, skip_bias_add,
                 is_expert, skip_weight_param_allocation=False, tp_comm_buffer_name=None, tp_group=None, **kwargs):
        if config.normalization != "RMSNorm":
            raise NotImplementedError("CpuLayerNormColumnParallelLinear: RMSNorm only (Qwen3.5)")
        accepted = inspect.signature(ColumnParallelLinear.__init__).parameters
        super().__init__(input_size, output_size, config=config, init_method=init_method,
                         gather_output=gather_output, bias=bias, skip_bias_add=skip_bias_add, is_expert=is_expert,
                         skip_weight_param_allocation=skip_weight_param_allocation,
                         tp_comm_buffer_name=tp_comm_buffer_name, tp_group=tp_group,
                         **{k: v for k, v in kwargs.items() if k in accepted})
        norm = CpuRMSNorm(config, input_size, eps=config.layernorm_epsilon)
        self.layer_norm_weight = norm.weight  # TE's name
        self.zero_centered, self.eps = norm.zero_centered, norm.eps

    def forward(self, x, *args, **kwargs):
        w = 1 + self.layer_norm_weight if self.zero_centered else self.layer_norm_weight
        x = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + self.eps) * w
        return super().forward(x, *args, **kwargs)


class CpuSpecProvider:
    """megatron's ``LocalSpecProvider`` with TE's fused norm + linear (:class:`CpuLayerNormColumnParallelLinear`) and
    :class:`CpuRMSNorm` for every norm: the TE block spec's structure on CPU modules."""

    def __init__(self):
        from megatron.core.models.backends import LocalSpecProvider

        self._local = LocalSpecProvider()

    def __getattr__(self, name):
        return getattr(self._local, name)

    def fuse_layernorm_and_linear(self) -> bool:
        return True

    def column_parallel_layer_norm_linear(self):
        return CpuLayerNormColumnParallelLinear

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False, has_residual: bool = False):
        if not rms_norm:
            raise NotImplementedError("CpuSpecProvider: RMSNorm only (Qwen3.5)")
        return CpuRMSNorm


def _cpu_self_attention_spec(config, backend=None):
    """The TE spec's gated self-attention (``_get_self_attention_module_spec``) on CPU modules: the input norm fused
    into ``linear_qkv``, q / k norms, megatron's ``DotProductAttention``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    attn = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=config.qk_layernorm).submodules \
        .self_attention
    sub = dataclasses.replace(attn.submodules, linear_qkv=CpuLayerNormColumnParallelLinear,
                              q_layernorm=CpuRMSNorm if config.qk_layernorm else attn.submodules.q_layernorm,
                              k_layernorm=CpuRMSNorm if config.qk_layernorm else attn.submodules.k_layernorm)
    return dataclasses.replace(attn, submodules=sub, metainfo={**attn.metainfo, "fuse_input_layernorm": True})


@contextlib.contextmanager
def _cpu_backend():
    from megatron.core.models.gpt import experimental_attention_variant_module_specs as ev

    saved = ev._get_backend_spec_provider, ev._get_self_attention_module_spec
    ev._get_backend_spec_provider = lambda config: CpuSpecProvider()
    ev._get_self_attention_module_spec = _cpu_self_attention_spec
    try:
        yield ev
    finally:
        ev._get_backend_spec_provider, ev._get_self_attention_module_spec = saved


def cpu_hybrid_block_spec(config, vp_stage=None, pp_rank=None):
    """G2: megatron's ``get_transformer_block_with_experimental_attention_variant_spec`` (the Qwen3.5 provider's
    ``transformer_layer_spec``) built on :class:`CpuSpecProvider` (same signature, same layers and names)."""
    with _cpu_backend() as ev:
        return ev.get_transformer_block_with_experimental_attention_variant_spec(config, vp_stage=vp_stage,
                                                                                 pp_rank=pp_rank)


# ---------------------------------------------------------------------------------------------------- tiny model
#: :func:`build_hybrid_gpt`'s Qwen3.5-shaped layers: a gated delta-net (2 key heads, 4 value heads of 8, conv 4), then
#: gated full attention (4 heads in 2 groups of 16, q / k norms, half the head dims rotated)
HYBRID = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
              ffn_hidden_size=96, qk_layernorm=True, layernorm_zero_centered_gamma=True, attention_output_gate=True,
              experimental_attention_variant="gated_delta_net", linear_attention_freq=[1, 0],
              linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
              linear_num_value_heads=4)
ROTARY_PERCENT = 0.5


def build_hybrid_gpt(*, zorro: bool, seed: int = 0, vocab: int = 96, config: dict | None = None,
                     sequence_parallel: bool = False, parallel_output: bool = False):
    """A tiny fp64 Qwen3.5-shaped ``GPTModel`` (:data:`HYBRID`) on :func:`cpu_hybrid_block_spec`, at the TP size of
    megatron's model-parallel groups (``sequence_parallel`` when TP > 1; ``parallel_output``: the head's logits
    left vocabulary-parallel). Every
    1-D parameter (norms, ``A_log``, ``dt_bias``) is drawn at random from ``seed`` so each one moves the outputs;
    ``zorro``: the mixers made zorro's by :func:`~zorro_verl.integrations.megatron.install_zorro_megatron`;
    ``config``: more ``TransformerConfig`` fields (activation recomputation)."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.parallel_state import get_tensor_model_parallel_world_size
    from megatron.core.transformer.transformer_config import TransformerConfig

    install_fla_standins()
    tp = get_tensor_model_parallel_world_size()
    cfg = TransformerConfig(
        **HYBRID, use_cpu_initialization=True, gradient_accumulation_fusion=False, params_dtype=torch.float64,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, masked_softmax_fusion=False, bias_activation_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        attention_softmax_in_fp32=False, pipeline_dtype=torch.float64, transformer_impl="local",
        tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel and tp > 1, **(config or {}))
    torch.manual_seed(seed)
    model = GPTModel(config=cfg, transformer_layer_spec=cpu_hybrid_block_spec(cfg), vocab_size=vocab,
                     max_sequence_length=64, position_embedding_type="rope", rotary_percent=ROTARY_PERCENT,
                     share_embeddings_and_output_weights=False, parallel_output=parallel_output).to(torch.float64)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    if zorro:
        from zorro_verl.integrations.megatron import install_zorro_megatron

        install_zorro_megatron(model)
    return model


def install_bridge_standins() -> None:
    """G1, and the bridge's parameter-layout registry told the CPU modules' kinds (as it knows TE's): the fused norm
    + linear is column parallel, the norm replicated."""
    install_fla_standins()
    from megatron.bridge.models.conversion.param_mapping import AutoMapping

    AutoMapping.register_module_type("CpuLayerNormColumnParallelLinear", "column")
    AutoMapping.register_module_type("CpuRMSNorm", "replicated")


def save_tiny_qwen35(path: str, vocab: int) -> str:
    """A tiny Qwen3.5 text checkpoint (``Qwen3_5ForCausalLM``) at ``path`` from seed 0, shaped as :data:`HYBRID`
    (a gated delta-net layer, then gated full attention; hidden 64, untied head); every 1-D parameter drawn at
    random so each one moves the outputs."""
    import transformers

    h = HYBRID
    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=h["hidden_size"], intermediate_size=h["ffn_hidden_size"],
        num_hidden_layers=h["num_layers"], num_attention_heads=h["num_attention_heads"],
        num_key_value_heads=h["num_query_groups"], head_dim=h["kv_channels"],
        layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=h["linear_conv_kernel_dim"],
        linear_key_head_dim=h["linear_key_head_dim"], linear_value_head_dim=h["linear_value_head_dim"],
        linear_num_key_heads=h["linear_num_key_heads"], linear_num_value_heads=h["linear_num_value_heads"],
        max_position_embeddings=256, tie_word_embeddings=False, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": ROTARY_PERCENT})
    cfg.architectures = ["Qwen3_5ForCausalLM"]
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    model.save_pretrained(path)
    return path
