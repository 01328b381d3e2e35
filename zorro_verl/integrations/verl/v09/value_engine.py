"""The zorro FSDP value-head engine for verl >= 0.9 (the critic): ``FSDPEngineWithValueHead`` with the deduplicated
micro-batch forward of :class:`~zorro_verl.integrations.verl.v09.engine.ZorroFSDPEngineWithLMHead`
(docs/design/verl.md, "The critic").

verl builds the critic as ``AutoModelForTokenClassification`` with ``num_labels = 1`` (a ``Linear(H, 1)`` ``score``
head on the last hidden state, dropout 0) and reads its values at row ``b``'s positions ``[p_b - 1, p_b + r_b - 1)``
of the nested full-sequence output (``response_from_nested`` / ``no_padding_2_padding``: the last prompt token and
every response token but the last). This engine runs each micro-batch's packed row once per unique prompt
(:func:`~zorro_verl.integrations.transformers.step.zorro_values`) and writes the values of exactly those positions
into verl's nested layout (other entries 0, never read), so ``compute_values`` and ``update_critic`` (verl's
``value_loss``, global token normalisation) see the stock engine's numbers. Micro-batching, the all-rank agreement,
Ulysses SP, refusals and metrics are the LM-head engine's.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from verl.utils.device import get_device_id, get_device_name
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithValueHead

from zorro_verl.integrations.transformers.step import value_head, zorro_values
from zorro_verl.integrations.verl.v09.batching import (
    _standard_positions,
    common_batch_unsupported,
    micro_batch_plan,
    predict_next_outputs,
)
from zorro_verl.integrations.verl.v09.engine import ZorroFSDPEngineWithLMHead
from zorro_verl.packing.ulysses import ulysses_shard

__all__ = ["ZorroFSDPEngineWithValueHead"]


class ZorroFSDPEngineWithValueHead(ZorroFSDPEngineWithLMHead, FSDPEngineWithValueHead):
    """verl's FSDP value-model (critic) engine with zorro's deduplicated forward (see module docstring). With
    ``zorro.enable = false`` every method is the stock ``FSDPEngineWithValueHead``'s (the stock paths of the LM-head
    engine call ``super()``, which resolves to verl's value-head ``prepare_model_outputs``)."""

    def _zorro_model_unsupported(self):
        """The backbone's static refusals (LoRA dropout, Ulysses head counts) and a value head zorro's value step
        does not read (:func:`~zorro_verl.integrations.transformers.step.value_head`: trl's ``v_head`` wrapper, a
        head other than ``Linear(H, 1)``, a classifier dropout). ``logits_optimization`` does not apply: the value
        head has one output per token."""
        try:
            value_head(self.module)
        except ValueError as e:
            return str(e)
        return self._zorro_backbone_unsupported()

    def _zorro_batch_unsupported(self, data):
        reason = common_batch_unsupported(data)
        if reason is not None:
            return reason
        if self._zorro_multimodal(data):
            return ("multimodal inputs / 3-D position ids in the critic: zorro's value-head engine runs text value "
                    "models only")
        if "position_ids" in data.keys() and not _standard_positions(data["position_ids"]):
            return ("position_ids that do not count 0, 1, 2, ... along each row (verl's text layout): zorro recomputes "
                    "the positions on its packed row, so other positions would change results")
        return None

    def forward_step(self, micro_batch, loss_function, forward_only):
        if not self.zorro_active or not self._installed():
            return super().forward_step(micro_batch, loss_function, forward_only)
        device_name = get_device_name()
        micro_batch = micro_batch.to(get_device_id())
        plan, _, p = micro_batch_plan(micro_batch, self.zorro.plan_kwargs())
        self._zorro_count_plan(plan)
        shard = None
        if self.ulysses_sequence_parallel_size > 1:
            group = self.ulysses_parallel_group
            shard = ulysses_shard(plan, self.ulysses_sequence_parallel_size, torch.distributed.get_rank(group), group)

        autocast_dtype = getattr(self, "_autocast_dtype", torch.bfloat16)
        autocast_ctx = (nullcontext() if autocast_dtype == torch.float32
                        else torch.autocast(device_type=device_name, dtype=autocast_dtype))
        with autocast_ctx:
            values = zorro_values(self.module, plan, backend=self._zorro_backend, shard=shard)
            # verl's nested full-sequence layout; the positions verl reads are the predict-next ones
            model_output = {"values": predict_next_outputs(micro_batch, p, plan, values, None)["log_probs"]}
            return self._loss_and_output(model_output, micro_batch, loss_function, forward_only)
