"""Loading a causal LM for the standalone API (imports transformers; peft for an adapter)."""

from __future__ import annotations

import torch

__all__ = ["load_causal_lm"]


def _load_base(model_name_or_path: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(model_name_or_path, dtype=dtype, attn_implementation="sdpa")
    except ValueError as e:
        if "scaled_dot_product_attention" not in str(e):
            raise
        return AutoModelForCausalLM.from_pretrained(model_name_or_path, dtype=dtype, attn_implementation="eager")


def load_causal_lm(model_name_or_path: str, *, dtype: torch.dtype, device="cpu"):
    """A ``*ForCausalLM`` (hub id or local directory) with the ordinary ``sdpa`` attention, or ``eager`` for
    architectures transformers gives no SDPA path (gpt-oss: its sinks); zorro replaces it when installed, and
    ``uninstall_zorro`` restores it.

    A PEFT adapter (a directory or hub id holding ``adapter_config.json``) loads onto the base model its config
    names (``base_model_name_or_path``) as PEFT's ``PeftModel``, trainable (``is_trainable=True``): the adapter's
    parameters require grad and the base's are frozen, as PEFT trains an adapter. The actor trains what it loads;
    transformers' own adapter loading (``from_pretrained`` on the adapter) would attach it frozen (inference mode),
    and the first backward would find no parameter to train."""
    from transformers.utils import find_adapter_config_file

    if find_adapter_config_file(model_name_or_path) is None:
        return _load_base(model_name_or_path, dtype).to(device)
    from peft import PeftConfig, PeftModel

    base_path = PeftConfig.from_pretrained(model_name_or_path).base_model_name_or_path
    if not base_path:
        raise ValueError(f"model_name_or_path: {model_name_or_path!r} is a PEFT adapter whose adapter_config.json "
                         "names no base_model_name_or_path; set it to the base model's hub id or directory.")
    base = _load_base(base_path, dtype)
    if getattr(base, "_hf_peft_config_loaded", False):
        raise ValueError(f"model_name_or_path: the base model {base_path!r} of the PEFT adapter "
                         f"{model_name_or_path!r} holds an adapter itself (transformers attached it frozen); point "
                         "the adapter's base_model_name_or_path at a directory or hub id without adapter files.")
    return PeftModel.from_pretrained(base, model_name_or_path, is_trainable=True).to(device)
