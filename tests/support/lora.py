"""LoRA (PEFT) models for the LoRA tests of every integration (verl 0.9 engine, verl 0.7 actor, OpenRLHF).

PEFT initialises ``lora_B`` to 0, which makes a fresh adapter the identity and ``lora_A``'s first gradient 0: a
comparison from a fresh adapter would leave half the LoRA math unexercised, so :func:`wrap_lora` draws ``lora_B``
at random (seeded).
"""

from __future__ import annotations

import torch

__all__ = ["LORA_TARGETS", "wrap_lora"]

#: The LoRA target sets the tests run: PEFT's ``all-linear`` (every linear layer but the LM head) and a subset of
#: attention and MLP projections.
LORA_TARGETS = {"all-linear": "all-linear", "subset": ["q_proj", "v_proj", "down_proj"]}


def wrap_lora(model, target_modules="all-linear", *, rank: int = 8, alpha: int = 16, dropout: float = 0.0,
              seed: int = 0):
    """``model`` (a ``*ForCausalLM``, modified in place) as a ``PeftModel`` with one LoRA adapter (``default``) of
    ``rank`` / ``alpha`` / ``dropout`` on ``target_modules``, drawn from ``seed``: ``lora_A`` ~ N(0, 1/in),
    ``lora_B`` ~ N(0, 0.05^2). The base weights are frozen, the adapter's trainable."""
    from peft import LoraConfig, get_peft_model

    peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=target_modules,
                                            lora_dropout=dropout, bias="none", task_type="CAUSAL_LM"))
    # PEFT draws lora_A from the global generator: redraw it from ``seed`` so that two calls give the same adapter
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_A" in name:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype) / p.shape[1] ** 0.5)
            elif "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype) * 0.05)
    return peft

