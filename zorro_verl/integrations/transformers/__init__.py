"""Hugging Face transformers integration: the registered ``"zorro"`` attention, installing zorro on a model, and
the one model step (docs/design/attention.md, model-step.md).

* :mod:`.attention` — the function registered as ``"zorro"`` in ``AttentionInterface``;
* :mod:`.context` — :class:`StepContext` (plan, backend, :class:`LayerCalls`), the ``zorro_ctx`` kwarg;
* :mod:`.hybrid` — gated delta-net layers of hybrid models (Qwen3.5, Qwen3-Next, OLMo-hybrid);
* :mod:`.ssm` — Mamba-2 layers (Mamba2, Bamba, Granite 4 hybrid, Nemotron-H);
* :mod:`.mixers` — LFM2's short gated convs and MiniMax's lightning attention;
* :mod:`.install` — :func:`install_zorro` / :func:`uninstall_zorro` and the checked packed forward;
* :mod:`.step` — :func:`zorro_step`, used by every caller (:func:`zorro_values` for value models,
  :func:`zorro_logits` for callers that need the head rows' whole distribution);
* :mod:`.loading` — :func:`load_causal_lm`.
"""

from zorro_verl.integrations.transformers.attention import ZORRO_ATTN_NAME, register_zorro_attention
from zorro_verl.integrations.transformers.context import LayerCalls, StepContext
from zorro_verl.integrations.transformers.install import (
    check_layer_calls,
    expected_layer_calls,
    forward_packed,
    install_zorro,
    is_installed,
    uninstall_zorro,
)
from zorro_verl.integrations.transformers.loading import load_causal_lm
from zorro_verl.integrations.transformers.step import zorro_logits, zorro_step, zorro_values

__all__ = [
    "ZORRO_ATTN_NAME",
    "register_zorro_attention",
    "LayerCalls",
    "StepContext",
    "install_zorro",
    "uninstall_zorro",
    "is_installed",
    "expected_layer_calls",
    "check_layer_calls",
    "forward_packed",
    "load_causal_lm",
    "zorro_logits",
    "zorro_step",
    "zorro_values",
]
