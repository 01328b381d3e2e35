"""Loading a causal LM for the standalone API (imports transformers)."""

from __future__ import annotations

import torch

__all__ = ["load_causal_lm"]


def load_causal_lm(model_name_or_path: str, *, dtype: torch.dtype, device="cpu"):
    """A ``*ForCausalLM`` (hub id or local directory) with the ordinary ``sdpa`` attention; zorro replaces it when
    installed."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_name_or_path, dtype=dtype, attn_implementation="sdpa")
    return model.to(device)
