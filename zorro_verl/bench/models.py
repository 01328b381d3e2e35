"""The benchmark's models: randomly initialised ``*ForCausalLM`` built from a config of a named shape (no download).

``MODEL_SHAPES``: Qwen3 shapes (every layer full attention); ``HYBRID_SHAPES``: Qwen3.5 text shapes (gated
delta-net layers + full attention). Parameters in the requested dtype on the requested device. Imports
transformers lazily.
"""

from __future__ import annotations

import torch

__all__ = ["MODEL_SHAPES", "HYBRID_SHAPES", "build_config", "build_model"]

MODEL_SHAPES = {
    # >= 4 layers, hidden 256, GQA 4/2 heads of 64: small enough for a 2-core CPU, shaped like Qwen3.
    "quick": dict(vocab_size=4096, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, intermediate_size=768, tie_word_embeddings=False),
    # Qwen/Qwen3-0.6B's config.json dimensions.
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, intermediate_size=3072, tie_word_embeddings=True),
}

#: Hybrid (gated delta-net + full attention) shapes: Qwen3.5 dense text models, 3 linear-attention layers per full
#: attention layer as in Qwen3.5 / Qwen3-Next.
HYBRID_SHAPES = {
    "hybrid-quick": dict(vocab_size=4096, hidden=256, heads=4, linear_k_heads=2, linear_v_heads=4,
                         linear_head_dim=64, layer_types=("linear_attention",) * 3 + ("full_attention",)),
}


def build_config(shape: str):
    """The transformers config of ``MODEL_SHAPES[shape]`` (``Qwen3Config``) or ``HYBRID_SHAPES[shape]`` (Qwen3.5
    text), attention implementation ``sdpa`` (the ordinary forward the benchmark compares against)."""
    from transformers import Qwen3Config

    if shape in HYBRID_SHAPES:
        from zorro_verl.testing import tiny_hybrid_config

        cfg = tiny_hybrid_config("qwen3_5", **HYBRID_SHAPES[shape])
    elif shape in MODEL_SHAPES:
        cfg = Qwen3Config(max_position_embeddings=40960, rope_theta=1000000.0, attention_dropout=0.0,
                          **MODEL_SHAPES[shape])
    else:
        raise ValueError(f"--model: expected one of {sorted(MODEL_SHAPES) + sorted(HYBRID_SHAPES)}, got {shape!r}.")
    cfg._attn_implementation = "sdpa"
    return cfg


def build_model(shape: str, dtype: torch.dtype, device: str, seed: int = 0):
    """A randomly initialised ``*ForCausalLM`` of :func:`build_config` ``(shape)`` in ``dtype`` on ``device``."""
    from transformers import AutoModelForCausalLM

    cfg = build_config(shape)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype).to(device)
