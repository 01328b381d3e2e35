"""The benchmark's models: randomly initialised ``*ForCausalLM`` built from a config of a named shape (no download).

``MODEL_SHAPES``: Qwen3 shapes (every layer full attention); ``HYBRID_SHAPES``: Qwen3.5 text shapes (gated
delta-net layers + full attention); ``VLM_SHAPES``: Qwen2.5-VL shapes (``*ForConditionalGeneration``: a Qwen2.5
language model with 3-D rotary positions and a vision tower). Parameters in the requested dtype on the requested
device. Imports transformers lazily.
"""

from __future__ import annotations

import torch

__all__ = ["MODEL_SHAPES", "HYBRID_SHAPES", "VLM_SHAPES", "build_config", "build_model", "build_vlm_config",
           "build_vlm_model"]

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


#: Qwen2.5-VL shapes: ``text`` (the language model), ``vision`` (the tower: patch 14, temporal patch 2, merge 2,
#: windows of 112 pixels = 4 x 4 merged tokens, full attention in the blocks of ``fullatt_block_indexes``) and the
#: placeholder / marker token ids.
VLM_SHAPES = {
    # The text model of the ``quick`` shape (hidden 256, 4 layers, GQA 4/2 heads of 64, MLP 768, vocabulary 4096;
    # 3-D rotary sections 8/12/12 of the 32 frequencies, Qwen2.5-VL's 16/24/24 halved) and a 4-block tower of
    # hidden 128 (2 heads of 64, SwiGLU MLP 320: Qwen2.5-VL's 1280 / 3420 ratio), blocks 0-2 windowed, block 3 full
    # (Qwen2.5-VL: every 8th); the merger maps 4 x 128 -> 256. CPU-sized: per image token the tower costs ~1.5x what
    # the language model costs per token (Qwen2.5-VL-3B: ~0.8x).
    "vlm-quick": dict(
        text=dict(vocab_size=4096, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=64, intermediate_size=768, max_position_embeddings=40960, rope_theta=1000000.0,
                  attention_dropout=0.0, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                  rope_scaling={"type": "mrope", "mrope_section": [8, 12, 12]}),
        vision=dict(depth=4, hidden_size=128, intermediate_size=320, num_heads=2, out_hidden_size=256, patch_size=14,
                    spatial_merge_size=2, temporal_patch_size=2, in_channels=3, window_size=112,
                    fullatt_block_indexes=[3]),
        tokens=dict(image_token_id=4093, video_token_id=4094, vision_start_token_id=4091, vision_end_token_id=4092,
                    tie_word_embeddings=False)),
    # Qwen/Qwen2.5-VL-3B-Instruct's config.json dimensions.
    "qwen2.5-vl-3b": dict(
        text=dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=36, num_attention_heads=16,
                  num_key_value_heads=2, head_dim=128, intermediate_size=11008, max_position_embeddings=128000,
                  rope_theta=1000000.0, attention_dropout=0.0, tie_word_embeddings=True,
                  rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}),
        vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                    patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3, window_size=112,
                    fullatt_block_indexes=[7, 15, 23, 31]),
        tokens=dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
                    vision_end_token_id=151653, tie_word_embeddings=True)),
}


def build_vlm_config(shape: str):
    """The ``Qwen2_5_VLConfig`` of ``VLM_SHAPES[shape]``, attention ``sdpa`` everywhere (language model and tower)."""
    from transformers import Qwen2_5_VLConfig

    if shape not in VLM_SHAPES:
        raise ValueError(f"--model: a vision-language run (--vlm) expects one of {sorted(VLM_SHAPES)}, got {shape!r}.")
    spec = VLM_SHAPES[shape]
    cfg = Qwen2_5_VLConfig(text_config=dict(spec["text"]), vision_config=dict(spec["vision"]), **spec["tokens"])
    for c in (cfg, cfg.text_config, cfg.vision_config):
        c._attn_implementation = "sdpa"
    return cfg


def build_vlm_model(shape: str, dtype: torch.dtype, device: str, seed: int = 0):
    """A randomly initialised ``Qwen2_5_VLForConditionalGeneration`` of :func:`build_vlm_config` ``(shape)``."""
    from transformers import AutoModelForImageTextToText

    cfg = build_vlm_config(shape)
    torch.manual_seed(seed)
    return AutoModelForImageTextToText.from_config(cfg, dtype=dtype).to(device)
