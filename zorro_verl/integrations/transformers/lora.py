"""LoRA (PEFT) models under zorro (docs/design/model-step.md "LoRA (PEFT) models").

LoRA adds a low-rank matmul to token-wise linear layers (``y = W x + s B A x``): every token's output still depends
on that token's input only, so the deduplicated forward computes a shared prompt token once with the adapter as the
ordinary forward computes it ``n`` times, and the split-attention math is unchanged. The model object is a PEFT
wrapper (``PeftModel`` around the ``*ForCausalLM``), which forwards zorro's ``zorro_ctx`` kwarg and attribute
lookups (``config``, ``get_output_embeddings``, ``set_attn_implementation``) to the wrapped model; the reference
policy of a LoRA run is the same module under ``disable_adapter()``, which zorro's forward honours like any other.

What differs by design is LoRA **dropout** in training mode: the ordinary forward draws an independent dropout mask
for each of a prompt's ``n`` rows, the deduplicated one computes the prompt once (one mask), so the two forwards
sample different functions. Zorro refuses it (:func:`lora_unsupported`) instead of proving a different equality.

Detects PEFT's LoRA layers by their attributes (``lora_A`` / ``lora_dropout`` module dicts); only
:func:`apply_lora` imports peft (lazily).
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["lora_layers", "lora_unsupported", "apply_lora", "lora_flops_per_token"]


def lora_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(name, module)`` of every PEFT LoRA layer of ``model`` (a module holding ``lora_A`` and ``lora_dropout``
    module dicts, keyed by adapter name)."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(getattr(m, "lora_A", None), torch.nn.ModuleDict)
            and isinstance(getattr(m, "lora_dropout", None), torch.nn.ModuleDict)]


def lora_unsupported(model: torch.nn.Module) -> Optional[str]:
    """Why zorro cannot run ``model``'s PEFT adapters exactly, or None: a prompt-learning adapter (prompt tuning,
    prefix tuning, p-tuning: PEFT adds virtual tokens to every input row, as prepended embeddings or as per-layer
    prefix keys / values, which zorro's plan of the packed row does not hold), a LoRA dropout probability > 0 on
    any adapter (see the module docstring), or an activated LoRA (aLoRA): PEFT looks for each input row's invocation
    tokens (``alora_invocation_tokens``) in that row and applies the adapter from there on; on zorro's packed row
    (all groups in one row) it would find one invocation only, and the other groups' responses would run without
    it."""
    for adapter, cfg in (getattr(model, "peft_config", None) or {}).items():
        if getattr(cfg, "is_prompt_learning", False):
            kind = getattr(cfg.peft_type, "value", cfg.peft_type)
            return (f"PEFT prompt learning (adapter {adapter!r} is {kind}; prompt tuning / prefix tuning / p-tuning) "
                    f"adds virtual tokens (num_virtual_tokens={getattr(cfg, 'num_virtual_tokens', None)}) to every "
                    "input row, which zorro's packed row of deduplicated prompts has no place for: not supported by "
                    "zorro; use a LoRA adapter or set zorro off")
        if getattr(cfg, "alora_invocation_tokens", None):
            return (f"activated LoRA (aLoRA: adapter {adapter!r} has alora_invocation_tokens): PEFT finds the "
                    "invocation per input row, and zorro's packed row holds several prompts, so responses would lose "
                    "their adapter; use a plain LoRA adapter (alora_invocation_tokens=None) or run without zorro")
    for name, layer in lora_layers(model):
        for adapter, drop in layer.lora_dropout.items():
            p = float(getattr(drop, "p", 0.0) or 0.0)
            if p > 0:
                return (f"LoRA dropout > 0 (adapter {adapter!r} of {name}: p={p}): the ordinary forward draws one "
                        "dropout mask per row, zorro computes each shared prompt once, so the two would train "
                        "different functions; set lora_dropout=0")
    return None


def apply_lora(model: torch.nn.Module, rank: int, *, alpha: Optional[int] = None, target_modules="all-linear",
               dropout: float = 0.0):
    """Inject one PEFT LoRA adapter of ``rank`` (``lora_alpha`` ``alpha``, default ``2 * rank``; dropout
    ``dropout``) into ``model``'s ``target_modules`` **in place** and freeze its base weights, as verl's and
    OpenRLHF's LoRA runs do; returns PEFT's wrapper (``model`` itself now runs with the adapter)."""
    from peft import LoraConfig, get_peft_model

    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank: expected an int >= 1 (the LoRA rank), got {rank!r}.")
    return get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, target_modules=target_modules,
                                            lora_dropout=dropout, bias="none", task_type="CAUSAL_LM"))


def lora_flops_per_token(model: torch.nn.Module) -> int:
    """Forward matmul FLOPs per token of every LoRA adapter of ``model`` (all layers): ``2 r (in + out)`` per adapted
    linear layer (``x A^T`` then ``(.) B^T``; 2 FLOPs per multiply-add)."""
    total = 0
    for _, layer in lora_layers(model):
        for name, a in layer.lora_A.items():
            b = layer.lora_B[name]
            total += 2 * a.out_features * (a.in_features + b.out_features)
    return total
