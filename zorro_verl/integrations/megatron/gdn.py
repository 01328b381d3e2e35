"""Zorro's gated delta-net for megatron-core's ``GatedDeltaNet`` (hybrid models: Qwen3.5, Qwen3-Next; docs/design/
megatron.md "Hybrid models").

A gated delta-net layer mixes the sequence twice, both causally: a depthwise causal conv over the q / k / v channels
and the gated delta rule, a recurrence over a state ``S [H, Dk, Dv]`` per row. On zorro's packed row ``[P | R1 | R2 |
...]`` run as one sequence, ``R2`` would start from the state ``R1`` left. With a :class:`ZorroPackedSeqParams` the
layer runs :mod:`zorro_verl.recurrent.packed` instead: each prompt once, every response from its prompt's final
recurrent state and conv context (the last ``Kc-1`` conv inputs), autograd summing each response's use of them back
into the prompt — the same functions the transformers integration runs for Qwen3.5 on FSDP. Everything else the layer
does is token-wise and runs unchanged on the packed row (``in_proj`` with its fused input norm, the q / k l2-norm, the
decay ``g`` and ``beta``, the gated output norm, ``out_proj``; under sequence parallelism ``in_proj`` gathers the row
and ``out_proj`` scatters it as usual). Every other call (no zorro plan) is megatron's own forward.

Kernels: megatron's own ``gated_delta_rule`` (flash-linear-attention's ``chunk_gated_delta_rule``, called varlen with
one initial state per response; in deterministic mode megatron's torch kernel, called on right-padded segments) and
torch's ``conv1d`` for the conv over the expanded row (exact; FLA's conv is not used on the packed row).
"""

from __future__ import annotations

import torch
from megatron.core import tensor_parallel

from zorro_verl.integrations.megatron.params import ZorroPackedSeqParams
from zorro_verl.recurrent.packed import packed_causal_conv, packed_gated_delta_rule

try:  # megatron-core >= 0.16 (gated delta-net); older versions have no such layer to wrap
    from megatron.core.ssm.gated_delta_net import common as _gdn_common
    from megatron.core.ssm.gated_delta_net.gdn import GatedDeltaNet
except ImportError:  # pragma: no cover - depends on the installed megatron-core
    GatedDeltaNet = None
    _gdn_common = None

__all__ = ["ZorroGatedDeltaNet", "zorro_gated_delta_net", "GatedDeltaNet"]

_ZORRO_GDN_CLASSES: dict = {}


class ZorroGatedDeltaNet:
    """Mixin placed in front of megatron's ``GatedDeltaNet`` (see :func:`zorro_gated_delta_net`).

    ``forward(hidden_states [Tp(/tp under SP), 1, hidden], attention_mask, packed_seq_params=ZorroPackedSeqParams)``
    returns ``(out [Tp(/tp), 1, hidden], bias | None)`` equal, token for token, to the layer's output on each ordinary
    row ``[prompt | response]``; pad tokens (sequence parallelism) get a zero mixer output. Any other call is
    ``GatedDeltaNet.forward``."""

    def forward(self, hidden_states, attention_mask, inference_context=None, packed_seq_params=None,
                sequence_len_offset=None, *, inference_params=None, **kwargs):
        zp = packed_seq_params
        if not isinstance(zp, ZorroPackedSeqParams):
            return super().forward(hidden_states, attention_mask, inference_context=inference_context,
                                   packed_seq_params=packed_seq_params, sequence_len_offset=sequence_len_offset,
                                   inference_params=inference_params, **kwargs)
        if inference_context is not None or inference_params is not None:
            raise ValueError("zorro gated delta-net: got an inference context; zorro runs training / log-prob "
                             "forwards without a cache. Call the model without inference_context.")
        if self.cp_size != 1:
            raise ValueError(f"zorro gated delta-net: context_parallel_size expected 1, got {self.cp_size} "
                             "(Context parallelism is not supported yet).")
        plan, T = zp.plan, zp.plan.T
        qkvzba, _ = self.in_proj(hidden_states)  # [Tp, 1, in_proj_dim / tp] (gathered under SP)
        Tp = qkvzba.shape[0]
        if qkvzba.dim() != 3 or qkvzba.shape[1] != 1 or Tp != zp.padded_len:
            raise ValueError(f"zorro gated delta-net: expected the packed row [{zp.padded_len}, 1, ...] after "
                             f"in_proj, got {tuple(qkvzba.shape)}.")
        qkv, gate, beta, alpha = torch.split(qkvzba[:T, 0], self.feat_dim_split, dim=-1)  # pad rows left out
        bias = self.conv1d.bias if self.conv_bias else None
        # each ordinary row's causal conv: responses read their prompt's last Kc-1 inputs (plus the activation)
        qkv = packed_causal_conv(qkv, self.conv1d.weight.squeeze(1), bias, plan, activation=self.activation)
        gate = gate.reshape(1, T, -1, self.value_head_dim)
        query, key, value, gate, beta, alpha = self._prepare_input_for_gated_delta_rule(
            qkv[None], gate, 1, T, beta[None], alpha[None])  # [1, T, H, D]: l2-norm, GQA repeat (token-wise)
        g, beta = self._compute_g_and_beta(self.A_log, self.dt_bias, alpha, beta)  # [1, T, H]
        kernel = self.gated_delta_rule
        # FLA's kernel takes cu_seqlens with one initial state per sequence; megatron's torch kernel does not
        varlen = kernel is not _gdn_common.torch_chunk_gated_delta_rule
        core = packed_gated_delta_rule(kernel, query[0], key[0], value[0], g[0], beta[0], plan, varlen=varlen,
                                       use_qk_l2norm_in_kernel=False)[None]  # [1, T, H, Dv]
        if self.recompute_norm_out:
            self.norm_out_checkpoint = tensor_parallel.CheckpointWithoutOutput()
            norm_out = self.norm_out_checkpoint.checkpoint(
                lambda c, z: self._gated_norm_and_a2a(c, z, None, 1, T, None), core, gate)
        else:
            norm_out = self._gated_norm_and_a2a(core, gate, None, 1, T, None)  # [T, 1, v_dim / tp]
        if Tp > T:  # pad rows: no mixer output (their hidden states never reach a real token)
            norm_out = torch.cat([norm_out, norm_out.new_zeros(Tp - T, 1, norm_out.shape[-1])])
        out, out_bias = self.out_proj(norm_out)
        if self.recompute_norm_out:
            self.norm_out_checkpoint.discard_output_and_register_recompute(out)
        zp.calls.count += 1
        return out, out_bias


def zorro_gated_delta_net(cls: type) -> type:
    """The zorro subclass of the gated delta-net class ``cls`` (cached; ``cls`` already one returns it)."""
    if issubclass(cls, ZorroGatedDeltaNet):
        return cls
    sub = _ZORRO_GDN_CLASSES.get(cls)
    if sub is None:
        sub = type(f"Zorro{cls.__name__}", (ZorroGatedDeltaNet, cls),
                   {"__module__": __name__, "__doc__": ZorroGatedDeltaNet.__doc__})
        _ZORRO_GDN_CLASSES[cls] = sub
    return sub
