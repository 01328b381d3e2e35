"""Loading a causal LM for the standalone API (imports transformers)."""

from __future__ import annotations

import torch

__all__ = ["load_causal_lm"]


def load_causal_lm(model_name_or_path: str, *, dtype: torch.dtype, device="cpu"):
    """A ``*ForCausalLM`` (hub id or local directory) with the ordinary ``sdpa`` attention, or ``eager`` for
    architectures transformers gives no SDPA path (gpt-oss: its sinks); zorro replaces it when installed, and
    ``uninstall_zorro`` restores it."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(model_name_or_path, dtype=dtype, attn_implementation="sdpa")
    except ValueError as e:
        if "scaled_dot_product_attention" not in str(e):
            raise
        model = AutoModelForCausalLM.from_pretrained(model_name_or_path, dtype=dtype, attn_implementation="eager")
    return model.to(device)
