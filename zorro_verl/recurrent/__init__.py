"""Recurrent layers on the packed dedup row (docs/design/model-step.md): the names of :mod:`.packed` (causal conv,
gated delta rule), :mod:`.ssd` (the Mamba-2 scan, the Mamba v1 selective scan) and
:mod:`.lightning` (MiniMax lightning attention).
Imports torch and :mod:`zorro_verl.packing` only."""

from zorro_verl.recurrent.lightning import packed_lightning_attention, recurrent_lightning_ref
from zorro_verl.recurrent.packed import (
    chunk_gated_delta_rule_ref,
    conv_expanded_index,
    packed_causal_conv,
    packed_gated_delta_rule,
    recurrent_gated_delta_rule_ref,
    recurrent_segment_index,
)
from zorro_verl.recurrent.ssd import (
    chunk_ssd,
    fused_ssd_kernel,
    packed_selective_scan,
    packed_ssd,
    recurrent_ssd_ref,
    selective_scan,
)

__all__ = ["conv_expanded_index", "packed_causal_conv", "recurrent_segment_index", "packed_gated_delta_rule",
           "chunk_gated_delta_rule_ref", "recurrent_gated_delta_rule_ref",
           "packed_ssd", "chunk_ssd", "fused_ssd_kernel", "recurrent_ssd_ref", "selective_scan",
           "packed_selective_scan",
           "packed_lightning_attention", "recurrent_lightning_ref"]
