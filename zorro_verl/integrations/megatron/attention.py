"""Zorro's core attention for megatron-core's ``GPTModel`` (docs/design/attention.md, megatron.md).

Megatron's ``SelfAttention`` projects q/k/v, applies q/k norms and RoPE, and calls its ``core_attention`` submodule as
``core_attention(query, key, value, attention_mask, attn_mask_type=, attention_bias=, packed_seq_params=)`` with
``query [s, b, Hq_local, D]``, ``key / value [s, b, Hkv_local, D]`` (heads local to the tensor-parallel rank, GQA
groups not yet repeated, the full sequence even under sequence parallelism) and expects ``[s, b, Hq_local * D]``.

Zorro's plan reaches that call as ``packed_seq_params``: a :class:`ZorroPackedSeqParams` (a ``PackedSeqParams``
subclass) whose ``qkv_format`` is ``"sbhd"``, so megatron treats the packed row as one ``[T, 1, ...]`` sequence (no
THD squeeze, no per-segment RoPE) and hands the object on unchanged; it is captured by closure, not saved for
backward, so megatron's activation recomputation sees it too. The zorro core attention is a subclass of the core
attention the layer spec names (megatron's local ``DotProductAttention``, Transformer Engine's, ...): a call whose
``packed_seq_params`` is a zorro one runs the project's split attention (:func:`zorro_verl.attention.attend`), every
other call runs the wrapped class's own ``forward`` unchanged. Being a subclass, it keeps the state-dict names (e.g.
a learnable ``softmax_offset``) and can be put in place before the model is built (:func:`zorro_layer_spec`) or after
(:func:`install_zorro_megatron`, a class swap of each instance).

Multi-latent attention (``MLASelfAttention``) calls the same core attention with ``query / key [s, Hq_local, Dqk]``,
``value [s, Hq_local, Dv]`` (it drops the batch dimension whenever ``packed_seq_params`` is given; ``Dqk =
qk_head_dim + qk_pos_emb_head_dim``, ``Dv = v_head_dim``) and rotates with its own ``rotary_pos_emb`` inside its
projections: its layers become :class:`ZorroMLA` (the same two ways), which positions that table per token.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import torch
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.multi_latent_attention import MultiLatentAttention
from megatron.core.transformer.spec_utils import ModuleSpec

from zorro_verl.attention import attend
from zorro_verl.attention.context_parallel import cp_attend
from zorro_verl.integrations.megatron.gdn import GatedDeltaNet, ZorroGatedDeltaNet, zorro_gated_delta_net
from zorro_verl.integrations.megatron.params import ZORRO_QKV_FORMAT, ZorroPackedSeqParams

__all__ = ["ZorroPackedSeqParams", "ZorroCoreAttention", "zorro_core_attention", "zorro_layer_spec",
           "install_zorro_megatron", "zorro_attention_modules", "ZORRO_QKV_FORMAT", "ZorroMLA", "zorro_mla_attention",
           "PositionedRope"]

class ZorroCoreAttention:
    """Mixin placed in front of a megatron core-attention class (see :func:`zorro_core_attention`).

    ``forward(query [Tp, 1, Hq_l, D], key [Tp, 1, Hkv_l, D], value, attention_mask, ...)`` with a
    :class:`ZorroPackedSeqParams` returns ``[Tp, 1, Hq_l * D]`` (``Tp`` the padded row, ``Hq_l`` / ``Hkv_l`` the
    rank's heads); from MLA ``query / key [Tp, Hq_l, Dqk]``, ``value [Tp, Hq_l, Dv]`` -> ``[Tp, 1, Hq_l * Dv]``; any
    other call is the wrapped class's ``forward``.
    """

    def __init__(self, *args, **kwargs):
        config = kwargs.get("config", args[0] if args else None)
        self._zorro_cp_only = False
        if getattr(config, "context_parallel_size", 1) > 1 and _local_attention(type(self)):
            # megatron's local DotProductAttention asserts context_parallel_size == 1 (it has no CP exchange); zorro
            # calls carry their own (cp_attend), so the local class is built on a CP = 1 copy of the config and
            # every non-zorro call is refused (it would attend within this rank's tokens only)
            cfg1 = copy.copy(config)
            cfg1.context_parallel_size = 1
            args, kwargs = ((cfg1, *args[1:]), kwargs) if args else (args, {**kwargs, "config": cfg1})
            super().__init__(*args, **kwargs)
            self.config = config
            self._zorro_cp_only = True
        else:
            super().__init__(*args, **kwargs)
        # The wrapped classes fold apply_query_key_layer_scaling into their own scale and undo it in the softmax;
        # zorro needs the plain softmax scale: the one the layer passes, or megatron's default 1/sqrt(kv_channels).
        scale = kwargs.get("softmax_scale")
        self._zorro_scale = float(scale) if scale is not None else 1.0 / math.sqrt(self.config.kv_channels)
        self._zorro_attn_mask_type = kwargs.get("attn_mask_type", args[2] if len(args) > 2 else None)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        if not isinstance(packed_seq_params, ZorroPackedSeqParams):
            if self._zorro_cp_only:
                raise ValueError(f"context_parallel_size: got {self.config.context_parallel_size} on megatron's local "
                                 "DotProductAttention, which has no context-parallel exchange: only zorro calls "
                                 "(a ZorroPackedSeqParams with a CP shard) run here. Use Transformer Engine's "
                                 "attention for ordinary CP calls, or context_parallel_size=1.")
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias, packed_seq_params=packed_seq_params, **kwargs)
        self._zorro_refusals(query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params,
                             kwargs)
        zp = packed_seq_params
        plan, T = zp.plan, zp.plan.T
        if zp.cp is not None:  # this rank's L tokens (pads included: cp_attend outputs 0 there)
            q, k, v = ((x[:, 0] if x.dim() == 4 else x).permute(1, 0, 2).unsqueeze(0) for x in (query, key, value))
            out = cp_attend(plan, zp.backend, zp.cp, q, k, v, self._zorro_scale)  # [1, L, Hq_l, Dv]
            zp.calls.count += 1
            return out[0].reshape(zp.padded_len, 1, -1)
        # [Tp, 1, H, D] (or MLA's [Tp, H, D]) -> [1, H, T, D]: the backends' layout; the padding rows (sequence
        # parallelism) are left out
        q, k, v = ((x[:T, 0] if x.dim() == 4 else x[:T]).permute(1, 0, 2).unsqueeze(0) for x in (query, key, value))
        out = attend(plan, zp.backend, q, k, v, self._zorro_scale)  # [1, T, Hq_l, Dv] (Dv: v's head dim)
        out = out[0].reshape(T, 1, -1)
        if query.shape[0] > T:  # pad rows: no attention, output 0 (their hidden states never reach a real token)
            out = torch.cat([out, out.new_zeros(query.shape[0] - T, 1, out.shape[-1])], 0)
        zp.calls.count += 1
        return out

    def _zorro_refusals(self, query, key, value, attention_mask, attn_mask_type, attention_bias, zp,
                        kwargs) -> None:
        cfg = self.config
        if zp.plan is None or zp.calls is None:
            raise ValueError("packed_seq_params: a ZorroPackedSeqParams without a plan; build it with "
                             "ZorroPackedSeqParams.for_plan(plan, backend, padded_len).")
        # MLA hands [Tp, H, D] (it squeezes the batch dimension whenever packed_seq_params is given)
        sbhd = query.dim() == 4 and query.shape[1] == 1
        if not (sbhd or query.dim() == 3) or query.shape[0] != zp.padded_len:
            raise ValueError(f"query: expected [padded_len={zp.padded_len}, 1, heads, head_dim] (one packed row in "
                             f"sbhd layout; [padded_len, heads, head_dim] from MLA), got {tuple(query.shape)}. Run "
                             "the model on the plan's packed row.")
        if key.dim() != query.dim() or value.dim() != query.dim() or key.shape[:-1] != value.shape[:-1] \
                or key.shape[0] != query.shape[0] or key.shape[-1] != query.shape[-1]:
            raise ValueError(f"key / value: expected the query's layout with its q/k head dim ({query.shape[-1]}) "
                             f"on the key, got query {tuple(query.shape)}, key {tuple(key.shape)}, value "
                             f"{tuple(value.shape)}.")
        hq, hkv = query.shape[-2], key.shape[-2]
        if hkv == 0 or hq % hkv:
            raise ValueError(f"key: expected a number of heads dividing the query's ({hq}), got {hkv}.")
        mask_type = attn_mask_type if attn_mask_type is not None else self._zorro_attn_mask_type
        if mask_type is not None and mask_type != AttnMaskType.causal:
            raise ValueError(f"attn_mask_type: expected AttnMaskType.causal (zorro runs causal decoders), got "
                             f"{mask_type}. Use zorro only on causal self-attention layers.")
        if attention_mask is not None:
            raise ValueError("attention_mask: expected None with a zorro plan (the plan is the mask), got a tensor. "
                             "Call the model with attention_mask=None.")
        if attention_bias is not None:
            raise ValueError("attention_bias: expected None with a zorro plan, got a tensor; attention biases are "
                             "not supported.")
        if kwargs:
            raise ValueError(f"core attention keywords: expected none beyond megatron's, got {sorted(kwargs)}; "
                             "zorro does not know what they change.")
        cp = getattr(cfg, "context_parallel_size", 1)
        if cp != (zp.cp.cp_size if zp.cp is not None else 1):
            raise ValueError(f"context_parallel_size: the model has {cp}, the zorro params a CP shard of "
                             f"{zp.cp.cp_size if zp.cp is not None else 'none (1)'}; build the params with "
                             "ZorroPackedSeqParams.for_plan(plan, backend, shard.local_len, cp=shard) for the "
                             "model's CP group (zorro_gpt_forward does).")
        if self.training and getattr(cfg, "attention_dropout", 0.0):
            raise ValueError(f"attention_dropout: expected 0 with zorro in training, got {cfg.attention_dropout}. "
                             "Set attention_dropout=0 (RL training runs without dropout).")
        if getattr(cfg, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(f"softmax_type: expected 'vanilla' with zorro, got {cfg.softmax_type!r} (sinks / "
                             "off-by-one softmax are not wired to zorro's megatron attention yet).")
        if getattr(cfg, "window_size", None) is not None:
            raise ValueError(f"window_size: expected None with zorro, got {cfg.window_size!r} (sliding windows are "
                             "not wired to zorro's megatron attention yet).")


def _local_attention(cls: type) -> bool:
    """Whether ``cls`` derives from megatron's local ``DotProductAttention`` (which refuses CP at build)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return issubclass(cls, DotProductAttention)


class PositionedRope:
    """For one forward: ``rotary_pos_emb(...)`` returns the RoPE table indexed by per-token positions
    ``[Tp] int64`` -> ``[Tp, 1, 1, D]`` (an instance attribute over the class's ``forward``, removed on exit).
    ``tokens_first``: ``[Tp, 1, D]`` instead, for multi-latent attention, which rotates ``[Tp, heads, D]`` (it
    squeezes the batch dimension when ``packed_seq_params`` is given). A ``(table, mscale)`` pair (YaRN) keeps its
    ``mscale``."""

    def __init__(self, rope: torch.nn.Module, positions: torch.Tensor, tokens_first: bool = False,
                 whole_table: bool = False):
        self.rope, self.positions, self.tokens_first = rope, positions, tokens_first
        self.whole_table = whole_table

    def __enter__(self):
        had = "forward" in vars(self.rope)
        if had:
            raise ValueError("rotary_pos_emb.forward: already replaced on this instance (a zorro step inside "
                             "another?); run one zorro step at a time.")
        table_of = type(self.rope).forward.__get__(self.rope)
        positions, tokens_first, whole = self.positions, self.tokens_first, self.whole_table

        def at_positions(table):  # [S, 1, 1, D] -> [Tp, 1, 1, D] or [Tp, 1, D]
            table = table[positions]
            return table[:, 0] if tokens_first else table

        def forward(max_seq_len, *args, **kwargs):
            if whole:  # context parallelism: the table of every position (megatron would keep its CP rank's zigzag
                kwargs["packed_seq"] = True  # slice of it unless the sequence is packed); zorro's positions index it
            out = table_of(max_seq_len, *args, **kwargs)
            return (at_positions(out[0]), *out[1:]) if isinstance(out, tuple) else at_positions(out)

        self.rope.forward = forward
        return self

    def __exit__(self, *exc):
        del self.rope.forward
        return False


class ZorroMLA:
    """Mixin placed in front of a megatron multi-latent-attention class (``MLASelfAttention``): MLA computes its
    decoupled RoPE inside its q/k/v projections with its own ``rotary_pos_emb`` (RoPE or YaRN), by token index.
    With a :class:`ZorroPackedSeqParams` the projections run with that table at ``packed_seq_params.position_ids``
    (each token's position in its ordinary row, :class:`PositionedRope`, ``[Tp, 1, D]``); megatron's activation
    recomputation calls them again with the same params, so the recomputed table is the same. Every other call is
    the wrapped class's."""

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, position_ids=None,
                                    packed_seq_params=None, inference_context=None, **kwargs):
        if not isinstance(packed_seq_params, ZorroPackedSeqParams):
            return super().get_query_key_value_tensors(hidden_states, key_value_states, position_ids,
                                                       packed_seq_params, inference_context=inference_context,
                                                       **kwargs)
        if packed_seq_params.position_ids is None:
            raise ValueError("packed_seq_params.position_ids: expected the padded row's positions [padded_len] for "
                             "multi-latent attention, got None; build it with ZorroPackedSeqParams.for_plan.")
        with PositionedRope(self.rotary_pos_emb, packed_seq_params.position_ids, tokens_first=True):
            return super().get_query_key_value_tensors(hidden_states, key_value_states, position_ids,
                                                       packed_seq_params, inference_context=inference_context,
                                                       **kwargs)


_ZORRO_CLASSES: dict[type, type] = {}
_ZORRO_MLA_CLASSES: dict[type, type] = {}


def zorro_mla_attention(cls: type) -> type:
    """The zorro subclass of the multi-latent-attention class ``cls`` (cached; ``cls`` already one returns it)."""
    if issubclass(cls, ZorroMLA):
        return cls
    sub = _ZORRO_MLA_CLASSES.get(cls)
    if sub is None:
        sub = type(f"Zorro{cls.__name__}", (ZorroMLA, cls), {"__module__": __name__, "__doc__": ZorroMLA.__doc__})
        _ZORRO_MLA_CLASSES[cls] = sub
    return sub


def zorro_core_attention(cls: type) -> type:
    """The zorro subclass of the core-attention class ``cls`` (one per class, cached): zorro calls take the split
    attention, every other call is ``cls.forward``. ``cls`` already being a zorro class returns it."""
    if issubclass(cls, ZorroCoreAttention):
        return cls
    sub = _ZORRO_CLASSES.get(cls)
    if sub is None:
        sub = type(f"Zorro{cls.__name__}", (ZorroCoreAttention, cls), {"__module__": __name__,
                                                                        "__doc__": ZorroCoreAttention.__doc__})
        _ZORRO_CLASSES[cls] = sub
    return sub


def zorro_layer_spec(spec: ModuleSpec) -> ModuleSpec:
    """A copy of a GPT layer spec (``get_gpt_layer_local_spec()`` / TE spec, a ``ModuleSpec`` of a
    ``TransformerLayer``) whose self-attention core attention is the zorro subclass of the one it names (and a
    multi-latent attention the :class:`ZorroMLA` subclass of its class; a gated delta-net layer's mixer the
    :class:`~zorro_verl.integrations.megatron.gdn.ZorroGatedDeltaNet` subclass of its class). The
    original spec is not modified. ``ValueError`` when the spec has no self-attention core attention to wrap."""
    attn = getattr(getattr(spec, "submodules", None), "self_attention", None)
    if GatedDeltaNet is not None and isinstance(getattr(attn, "module", None), type) \
            and issubclass(attn.module, GatedDeltaNet):  # a hybrid model's gated delta-net layer
        new_attn = dataclasses.replace(attn, module=zorro_gated_delta_net(attn.module))
        return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=new_attn))
    try:
        attn = spec.submodules.self_attention
        core = attn.submodules.core_attention
    except AttributeError:
        raise ValueError("spec: expected a TransformerLayer ModuleSpec with submodules.self_attention.submodules."
                         f"core_attention, got {type(spec).__name__}. Pass a GPT layer spec.") from None
    if isinstance(core, ModuleSpec):
        new_core = dataclasses.replace(core, module=zorro_core_attention(core.module))
    elif isinstance(core, type):
        new_core = zorro_core_attention(core)
    else:
        raise ValueError(f"spec core_attention: expected a class or a ModuleSpec, got {type(core).__name__}.")
    new_attn_sub = dataclasses.replace(attn.submodules, core_attention=new_core)
    new_attn = dataclasses.replace(attn, submodules=new_attn_sub)
    if isinstance(new_attn.module, type) and issubclass(new_attn.module, MultiLatentAttention):
        new_attn = dataclasses.replace(new_attn, module=zorro_mla_attention(new_attn.module))
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=new_attn))


def install_zorro_megatron(model: torch.nn.Module) -> int:
    """Make every ``SelfAttention`` / ``MultiLatentAttention`` ``.core_attention`` of an already built model a zorro
    core attention, every MLA layer a :class:`ZorroMLA` and every gated delta-net a
    :class:`~zorro_verl.integrations.megatron.gdn.ZorroGatedDeltaNet` (class swaps of each instance: parameters,
    buffers and state-dict names unchanged; calls without a zorro plan behave as before). Returns how many were
    installed (idempotent); ``ValueError`` when the model has none."""
    n = 0
    for mod in model.modules():
        if GatedDeltaNet is not None and isinstance(mod, GatedDeltaNet):  # hybrid models' gated delta-nets
            mod.__class__ = zorro_gated_delta_net(type(mod))
            n += 1
        elif isinstance(mod, (SelfAttention, MultiLatentAttention)):
            if isinstance(mod, MultiLatentAttention) and not isinstance(mod, ZorroMLA):
                mod.__class__ = zorro_mla_attention(type(mod))
            core = mod.core_attention
            if not isinstance(core, ZorroCoreAttention):
                # the mixin's __init__ did not run: derive what it would have recorded from the instance (MLA
                # passes its own scale, mscale^2 / sqrt(qk_head_dim + qk_pos_emb_head_dim), to its core attention)
                core.__class__ = zorro_core_attention(type(core))
                scale = mod.softmax_scale if isinstance(mod, MultiLatentAttention) else mod.config.softmax_scale
                core._zorro_scale = float(scale) if scale is not None else 1.0 / math.sqrt(mod.config.kv_channels)
                core._zorro_attn_mask_type = getattr(mod, "attn_mask_type", None)
                # megatron's local attention under CP (built past its CP assertion, e.g. by a CPU stand-in): only
                # zorro calls, which carry their own CP exchange, may run
                core._zorro_cp_only = (getattr(mod.config, "context_parallel_size", 1) > 1
                                       and _local_attention(type(core)))
            n += 1
    if n == 0:
        raise ValueError("model: expected megatron SelfAttention / MultiLatentAttention layers, found none in "
                         f"{type(model).__name__}. Pass a megatron-core GPTModel (or a wrapper around one).")
    return n


def zorro_attention_modules(model: torch.nn.Module) -> list:
    """The zorro sequence mixers of ``model`` (this pipeline stage's layers), in module order: core attentions and
    gated delta-nets (:class:`~zorro_verl.integrations.megatron.gdn.ZorroGatedDeltaNet`), each called once per
    layer and step."""
    return [m for m in model.modules() if isinstance(m, (ZorroCoreAttention, ZorroGatedDeltaNet))]
