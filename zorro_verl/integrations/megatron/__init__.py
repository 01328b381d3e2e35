"""Zorro on megatron-core's ``GPTModel`` (docs/design/megatron.md): the split attention as the layers' core
attention (hybrid models: the gated delta-nets' packed recurrence), the plan carried by a ``PackedSeqParams``
subclass, per-token RoPE positions and the LM head at the response-predicting rows (or a value model's values
there). Imports megatron-core (``.venv-megatron``: ``scripts/setup_megatron_env.sh``)."""

from zorro_verl.integrations.megatron.attention import (
    ZorroCoreAttention,
    ZorroMLA,
    ZorroPackedSeqParams,
    install_zorro_megatron,
    zorro_attention_modules,
    zorro_core_attention,
    zorro_layer_spec,
    zorro_mla_attention,
)
from zorro_verl.integrations.megatron.gdn import ZorroGatedDeltaNet, zorro_gated_delta_net
from zorro_verl.integrations.megatron.step import (
    check_value_head,
    find_gpt_model,
    has_output_processor,
    padded_length,
    zorro_gpt_forward,
    zorro_gpt_logprobs,
    zorro_gpt_step,
    zorro_gpt_values,
)
from zorro_verl.integrations.megatron.vlm import VlmCall, find_vlm_model

__all__ = ["ZorroCoreAttention", "ZorroPackedSeqParams", "install_zorro_megatron", "zorro_attention_modules",
           "zorro_core_attention", "zorro_layer_spec", "zorro_gpt_step", "zorro_gpt_forward", "zorro_gpt_logprobs",
           "padded_length", "find_gpt_model", "has_output_processor", "ZorroMLA", "zorro_mla_attention",
           "ZorroGatedDeltaNet", "zorro_gated_delta_net", "zorro_gpt_values", "check_value_head",
           "VlmCall", "find_vlm_model"]
