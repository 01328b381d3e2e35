"""The zorro Megatron value-head engine for verl >= 0.9 (the critic on ``strategy: megatron``):
``MegatronEngineWithValueHead`` with the deduplicated micro-batch forward of
:class:`~zorro_verl.integrations.verl.v09.megatron_engine.ZorroMegatronEngineWithLMHead` (docs/design/megatron.md
"The Megatron critic").

verl builds the Megatron critic as its ``GPTModel`` with ``output_layer`` replaced by a value head
(``LinearForLastLayer``: ``Linear(H, 1)`` without bias, its output cast to fp32 and, under sequence parallelism,
all-gathered) and reads its values at row ``b``'s positions ``[p_b - 1, p_b + r_b - 1)`` of the nested full-sequence
output (``no_padding_2_padding``: the last prompt token and every response token but the last). This engine runs
each micro-batch's packed row once per unique prompt, the value head at every packed row as megatron's own call
(:func:`~zorro_verl.integrations.megatron.step.zorro_gpt_forward` with ``value_head=True``), and writes the values of
exactly those positions into verl's nested layout (other entries 0, never read), so ``compute_values`` and
``update_critic`` (verl's ``value_loss``, global token normalisation) see the stock engine's numbers. Micro-batching
(group-aware, the same count on every DP rank), the all-rank agreement, TP / SP / PP / VPP, refusals and metrics are
the LM-head engine's; ``logits_optimization`` and temperatures do not apply (one output per token).
"""

from __future__ import annotations

from typing import Optional

from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithValueHead

from zorro_verl.integrations.megatron import check_value_head, find_gpt_model, zorro_gpt_values
from zorro_verl.integrations.verl.v09.batching import predict_next_outputs
from zorro_verl.integrations.verl.v09.megatron_checks import megatron_setup_unsupported
from zorro_verl.integrations.verl.v09.megatron_engine import ZorroMegatronEngineWithLMHead

__all__ = ["ZorroMegatronEngineWithValueHead", "CRITIC_MEGATRON_FIX_HINT"]

#: How a user of verl's Megatron critic switches zorro off or to ``warn`` (quoted in refusals).
CRITIC_MEGATRON_FIX_HINT = ("disable zorro for the critic (critic.megatron.zorro.enable=false), or set "
                            "critic.megatron.zorro.on_unsupported=warn to run the stock forward for such batches")


class ZorroMegatronEngineWithValueHead(ZorroMegatronEngineWithLMHead, MegatronEngineWithValueHead):
    """verl's Megatron value-model (critic) engine with zorro's deduplicated forward (see module docstring). With
    ``zorro.enable = false`` every method is the stock ``MegatronEngineWithValueHead``'s (the stock paths of the
    LM-head engine call ``super()``, which resolves to verl's value-head ``forward_step`` /
    ``prepare_model_outputs``)."""

    zorro_fix_hint = CRITIC_MEGATRON_FIX_HINT
    _zorro_value_model = True

    def _zorro_static_unsupported(self):
        # logits_optimization does not apply to the value head (one output per token)
        return megatron_setup_unsupported(self.engine_config, self.model_config, "none")

    def _zorro_model_unsupported(self) -> Optional[str]:
        """The LM-head engine's model refusals and a last stage whose ``output_layer`` is not a per-token
        ``Linear(H, 1)`` value head (:func:`~zorro_verl.integrations.megatron.step.check_value_head`)."""
        for chunk in self.module:
            try:
                check_value_head(find_gpt_model(chunk))
            except ValueError as e:
                return str(e)
        return super()._zorro_model_unsupported()

    def _zorro_model_output(self, model, batch, plan, p, out):
        """verl's critic model output (``prepare_model_outputs`` wraps it as ``{"values": ...}``): the values of the
        response-predicting rows, ``[N]`` fp32, in verl's nested full-sequence layout ``[B, j]``."""
        values = zorro_gpt_values(model, plan, out)
        return predict_next_outputs(batch, p, plan, values, None)["log_probs"]
