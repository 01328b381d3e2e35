"""Recurrent (linear-attention) layers on the packed dedup row (docs/design/model-step.md): the names of :mod:`.packed`.
Imports torch and :mod:`zorro_verl.packing` only."""

from zorro_verl.recurrent.packed import (
    chunk_gated_delta_rule_ref,
    conv_expanded_index,
    packed_causal_conv,
    packed_gated_delta_rule,
    recurrent_gated_delta_rule_ref,
    recurrent_segment_index,
)

__all__ = ["conv_expanded_index", "packed_causal_conv", "recurrent_segment_index", "packed_gated_delta_rule",
           "chunk_gated_delta_rule_ref", "recurrent_gated_delta_rule_ref"]
