"""Helpers for testing the verl 0.9 engine plugin on CPU (used by tests/verl and the Ray test workers).

Builds stock and zorro engines from the same HF checkpoint (FSDP2, fp32, gloo), verl-layout batches (jagged, as
verl's trainer hands them to the engine), and verl's own PPO loss.
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import torch

__all__ = ["build_engine", "make_engine_batch", "ppo_loss_fn", "response_values"]


def build_engine(ckpt: str, *, zorro: bool, use_dynamic_bsz: bool = False, micro_batch_size: int = 2,
                 max_token_len: int = 64, use_remove_padding: bool = True, gradient_checkpointing: bool = False,
                 zorro_settings: Optional[dict] = None, lr: float = 1e-2):
    """An initialised engine (zorro or stock ``FSDPEngineWithLMHead``) on the tiny checkpoint ``ckpt``."""
    from verl.trainer.config.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine import FSDPEngineWithLMHead

    from zorro_verl.integrations.verl.engine import ZorroFSDPEngineWithLMHead
    from zorro_verl.integrations.verl.engine_config import ZorroFSDPEngineConfig

    model_config = HFModelConfig(path=ckpt, load_tokenizer=False, override_config={"attn_implementation": "sdpa"},
                                 use_remove_padding=use_remove_padding,
                                 enable_gradient_checkpointing=gradient_checkpointing)
    common = dict(strategy="fsdp2", model_dtype="fp32", use_torch_compile=False,
                  mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
                  use_dynamic_bsz=use_dynamic_bsz, micro_batch_size_per_gpu=micro_batch_size,
                  infer_micro_batch_size_per_gpu=micro_batch_size, max_token_len_per_gpu=max_token_len,
                  infer_max_token_len_per_gpu=max_token_len, use_remove_padding=use_remove_padding)
    if zorro:
        settings = {"enable": True, "attention_backend": "sdpa", **(zorro_settings or {})}
        engine_config = ZorroFSDPEngineConfig(zorro=settings, **common)
        cls = ZorroFSDPEngineWithLMHead
    else:
        engine_config = FSDPEngineConfig(**common)
        cls = FSDPEngineWithLMHead
    optim = FSDPOptimizerConfig(lr=lr, total_training_steps=10, weight_decay=0.0, clip_grad=1.0)
    engine = cls(model_config=model_config, engine_config=engine_config, optimizer_config=optim,
                 checkpoint_config=CheckpointConfig())
    engine.initialize()
    return engine


def make_engine_batch(*, batch_size: int = 8, num_prompts: int = 3, prompt_len: int = 6, response_len: int = 5,
                      vocab: int = 128, seed: int = 0, shuffle: bool = True, temperature: float = 1.0,
                      calculate_entropy: bool = True, use_dynamic_bsz: bool = False, micro_batch_size: int = 2,
                      max_token_len: int = 64, use_remove_padding: bool = True, global_batch_size=None):
    """A jagged verl batch (TensorDict) with training fields, built like verl's trainer does."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    from zorro_verl.testing import create_dummy_batch

    b = create_dummy_batch(batch_size=batch_size, num_unique_prompts=num_prompts, prompt_len=prompt_len,
                           response_len=response_len, device="cpu", include_training_fields=True, add_padding=True,
                           vocab_size=vocab, seed=seed, shuffle=shuffle)
    P = prompt_len
    fields = dict(b)
    fields["prompts"] = b["input_ids"][:, :P]
    td = tu.get_tensordict(fields)
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(td, temperature=temperature, calculate_entropy=calculate_entropy,
                         use_dynamic_bsz=use_dynamic_bsz, micro_batch_size_per_gpu=micro_batch_size,
                         max_token_len_per_gpu=max_token_len, use_remove_padding=use_remove_padding,
                         global_batch_size=global_batch_size if global_batch_size is not None else batch_size,
                         use_fused_kernels=False)
    return td


def ppo_loss_fn(loss_agg_mode: str = "token-mean"):
    """verl's ``ppo_loss`` bound to a minimal actor config (vanilla clip loss, no KL / entropy terms)."""
    from verl.workers.config import FSDPActorConfig
    from verl.workers.utils.losses import ppo_loss

    cfg = FSDPActorConfig(strategy="fsdp2", rollout_n=1, ppo_micro_batch_size_per_gpu=2, ppo_mini_batch_size=8,
                          use_dynamic_bsz=False, loss_agg_mode=loss_agg_mode, use_kl_loss=False, entropy_coeff=0.0)
    return partial(ppo_loss, cfg)


def response_values(nested: torch.Tensor, td) -> torch.Tensor:
    """verl's own slicing of a nested predict-next output to ``[B, Rmax]`` (zeros on pads)."""
    from verl.workers.utils.padding import no_padding_2_padding

    return no_padding_2_padding(nested, td)
