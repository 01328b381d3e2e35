"""Test and demo helpers, one job per module. Importing this package imports torch only (transformers is imported
inside the functions that build models).

* :mod:`~zorro_verl.testing.batches` — :func:`create_dummy_batch`, GRPO-shaped batches in verl's layout;
  :func:`batch_from_rows` from explicit rows, and agentic shapes (:func:`shared_system_rows`,
  :func:`multi_turn_rows`), multi-turn SFT samples (:func:`sft_conversations`).
* :mod:`~zorro_verl.testing.models` — tiny models built offline from a config (:func:`tiny_model`,
  :func:`tiny_hybrid_model`, :func:`tiny_ssm_model`, :func:`tiny_mixer_model`, :func:`tiny_window_model`,
  :func:`tiny_llama4_model` and their configs).
* :mod:`~zorro_verl.testing.fp64` — per-instance swaps that keep fp64 end to end (:func:`exact_fp64_norms`,
  :func:`exact_fp64_hybrid`, :func:`exact_fp64_ssm`) and an fp64 eager attention for the oracles
  (``"fp64_eager"``), so fp64 comparisons measure zorro, not transformers' fp32 casts.
* :mod:`~zorro_verl.testing.oracles` — the references: the ordinary per-row / batched forwards, and the dense mask and
  attention of a plan's packed row.
* :mod:`~zorro_verl.testing.compare` — gradient collection and error measures.
"""

from zorro_verl.testing.batches import (
    batch_from_rows,
    create_dummy_batch,
    multi_turn_rows,
    sft_conversations,
    shared_system_rows,
)
from zorro_verl.testing.compare import grad_rel_error, grads_of, max_rel_grad_error
from zorro_verl.testing.fp64 import exact_fp64_hybrid, exact_fp64_llama4, exact_fp64_norms, exact_fp64_ssm
from zorro_verl.testing.models import (
    HYBRID_KINDS,
    MIXER_KINDS,
    SSM_KINDS,
    WINDOW_KINDS,
    model_from_config,
    tiny_config,
    tiny_hybrid_config,
    tiny_hybrid_model,
    tiny_llama4_config,
    tiny_llama4_model,
    tiny_mixer_config,
    tiny_mixer_model,
    tiny_model,
    tiny_ssm_config,
    tiny_ssm_model,
    tiny_value_model,
    tiny_window_config,
    tiny_window_model,
)
from zorro_verl.testing.oracles import dense_attention_oracle, dense_mask, ordinary_logprobs, ordinary_logprobs_padded

__all__ = [
    "create_dummy_batch",
    "batch_from_rows",
    "shared_system_rows",
    "multi_turn_rows",
    "sft_conversations",
    "tiny_config",
    "tiny_model",
    "tiny_value_model",
    "HYBRID_KINDS",
    "tiny_hybrid_config",
    "tiny_hybrid_model",
    "model_from_config",
    "WINDOW_KINDS",
    "tiny_window_config",
    "tiny_window_model",
    "tiny_llama4_config",
    "tiny_llama4_model",
    "exact_fp64_norms",
    "exact_fp64_hybrid",
    "exact_fp64_ssm",
    "MIXER_KINDS",
    "SSM_KINDS",
    "tiny_ssm_config",
    "tiny_mixer_config",
    "tiny_mixer_model",
    "tiny_ssm_model",
    "exact_fp64_llama4",
    "ordinary_logprobs",
    "ordinary_logprobs_padded",
    "dense_mask",
    "dense_attention_oracle",
    "grads_of",
    "max_rel_grad_error",
    "grad_rel_error",
]
