"""Tiny vision-language models built from a config (offline, no download) and multimodal GRPO batches with their
ordinary per-row oracle. transformers is imported inside the functions, never at import."""

from __future__ import annotations

import types
from typing import Optional

import torch

from zorro_verl.testing.fp64 import _exact_normalized_router_forward, exact_fp64_hybrid, exact_fp64_norms
from zorro_verl.testing.models import _perturb_vectors

__all__ = ["VLM_KINDS", "exact_fp64_vision", "tiny_vlm_config", "tiny_vlm_model", "VlmRow", "image",
           "prompt_with_media", "agent_row", "vlm_batch", "ordinary_vlm_logprobs"]

#: ``kind`` names of :func:`tiny_vlm_config`.
VLM_KINDS = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5")
#: Token ids of the tiny configs (vocabulary 128): placeholders and the vision start / end markers.
IMAGE, VIDEO, V_START, V_END = 120, 121, 122, 123
#: Patch geometry of the tiny vision towers: patch 4, temporal patch 2, 3 channels -> 96 values per patch row.
PATCH, TEMPORAL, CHANNELS, MERGE = 4, 2, 3, 2
PATCH_DIM = CHANNELS * TEMPORAL * PATCH * PATCH


def tiny_vlm_config(kind: str = "qwen2_5_vl", *, hidden: int = 32, heads: int = 4, layers: int = 2,
                    vision_depth: int = 2):
    """A small vision-language config: a 2-layer language model (``qwen3_5``: linear / full attention) with 3-D
    rotary positions (sections over half the head dim ``hidden // heads``: 2/1/1 at 8), a ``vision_depth``-block
    vision tower (hidden 16, patch 4, merge 2; Qwen3-VL: deepstack from block 0), vocabulary 128."""
    hd = hidden // heads
    half = hd // 2
    section = [half - 2 * (half // 4), half // 4, half // 4]
    text = dict(vocab_size=128, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=heads // 2, head_dim=hd, intermediate_size=2 * hidden, max_position_embeddings=4096,
                attention_dropout=0.0, tie_word_embeddings=False)
    vision = dict(depth=vision_depth, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=hidden,
                  patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL, in_channels=CHANNELS)
    tokens = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=V_START,
                  vision_end_token_id=V_END, tie_word_embeddings=False)
    if kind == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig

        text["rope_scaling"] = {"type": "mrope", "mrope_section": section}
        return Qwen2_5_VLConfig(text_config=text, vision_config={**vision, "window_size": 2 * PATCH * MERGE,
                                                                 "fullatt_block_indexes": [vision_depth - 1]},
                                **tokens)
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section, "mrope_interleaved": True}
    deep = {"num_position_embeddings": 64, "deepstack_visual_indexes": [0]}
    if kind == "qwen3_vl":
        from transformers import Qwen3VLConfig

        return Qwen3VLConfig(text_config={**text, "rope_parameters": rope}, vision_config={**vision, **deep},
                             **tokens)
    if kind == "qwen3_vl_moe":
        from transformers import Qwen3VLMoeConfig

        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden, decoder_sparse_step=1)
        return Qwen3VLMoeConfig(text_config={**text, **moe, "rope_parameters": rope},
                                vision_config={**vision, **deep}, **tokens)
    if kind == "qwen3_5":
        from transformers import Qwen3_5Config

        lin = dict(layer_types=["linear_attention", "full_attention", "linear_attention"][:layers],
                   linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                   linear_num_value_heads=4)
        rope35 = {**rope, "partial_rotary_factor": 1.0}
        return Qwen3_5Config(text_config={**text, **lin, "rope_parameters": rope35},
                             vision_config={**vision, "num_position_embeddings": 64}, **tokens)
    raise ValueError(f"kind: expected one of {VLM_KINDS}, got {kind!r}.")


_VISION_ROPE_MODULES = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5")


def exact_fp64_vision() -> None:
    """Make the Qwen-VL vision towers' rotary embedding keep fp64 in fp64 (idempotent; test oracle only).

    ``apply_rotary_pos_emb_vision`` computes in fp32 whatever the input dtype and casts back. An image shared by n
    rows gets one backward through that cast in zorro (its n gradients summed first) against n in the per-row
    oracle, so fp32 rounding leaves ~1e-10 relative differences in the vision gradients that are not zorro's. The
    wrapper calls the original for every other dtype: fp32 / bf16 behaviour is unchanged.
    """
    import importlib

    for name in _VISION_ROPE_MODULES:
        mod = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        orig = mod.apply_rotary_pos_emb_vision
        if getattr(orig, "_zorro_fp64", False):
            continue

        def rope(q, k, cos, sin, _orig=orig, _rot=mod.rotate_half):
            if q.dtype != torch.float64:
                return _orig(q, k, cos, sin)
            cos, sin = cos.unsqueeze(-2).to(q.dtype), sin.unsqueeze(-2).to(q.dtype)
            return q * cos + _rot(q) * sin, k * cos + _rot(k) * sin

        rope._zorro_fp64 = True
        mod.apply_rotary_pos_emb_vision = rope


def tiny_vlm_model(kind: str = "qwen2_5_vl", *, dtype: torch.dtype = torch.float64, seed: int = 0,
                   attn_implementation: str = "sdpa", **cfg_kwargs):
    """A randomly initialised ``*ForConditionalGeneration`` from :func:`tiny_vlm_config`, deterministic per ``seed``;
    fp64 models keep fp64 in their norms (and the delta rule of ``qwen3_5``)."""
    from transformers import AutoModelForImageTextToText

    cfg = tiny_vlm_config(kind, **cfg_kwargs)
    cfg._attn_implementation = attn_implementation
    for sub in ("text_config", "vision_config"):
        getattr(cfg, sub)._attn_implementation = attn_implementation
    if kind == "qwen3_vl_moe" and dtype == torch.float64:
        cfg.text_config._experts_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(cfg, dtype=dtype)
    _perturb_vectors(model)
    if dtype == torch.float64:
        exact_fp64_vision()
        exact_fp64_norms(model)
        for mod in model.modules():  # Qwen3-VL-MoE's router: softmax in fp32, top-k always renormalised
            if type(mod).__name__ == "Qwen3VLMoeTextTopKRouter":
                mod.forward = types.MethodType(_exact_normalized_router_forward, mod)
        if kind == "qwen3_5":
            exact_fp64_hybrid(model)
    return model.eval()


class VlmRow:
    """One GRPO row: ``prompt`` and ``response`` token lists and ``media`` (the row's multimodal inputs dict:
    ``pixel_values [n, 96]``, ``image_grid_thw [k, 3]``; None for a text row)."""

    def __init__(self, prompt: list, response: list, media: Optional[dict] = None):
        self.prompt, self.response, self.media = list(prompt), list(response), media


def image(seed: int, h: int = 2, w: int = 2, dtype: torch.dtype = torch.float64) -> tuple:
    """A random image of ``h x w`` merged tokens: ``(pixels [4 h w, 96], grid [1, 3])`` (grid in patches)."""
    g = torch.Generator().manual_seed(seed)
    grid = torch.tensor([[1, h * MERGE, w * MERGE]])
    return torch.randn(int(grid.prod()), PATCH_DIM, generator=g, dtype=dtype), grid


def prompt_with_media(parts: list) -> tuple:
    """``parts``: token lists and ``(pixels, grid)`` images, in order -> ``(prompt tokens, media dict | None)`` with
    each image as ``<vision_start> <image> * tokens <vision_end>``."""
    toks, pix, grids = [], [], []
    for part in parts:
        if isinstance(part, tuple):
            p, g = part
            toks += [V_START] + [IMAGE] * (int(g.prod()) // MERGE ** 2) + [V_END]
            pix.append(p)
            grids.append(g)
        else:
            toks += list(part)
    if not pix:
        return toks, None
    return toks, {"pixel_values": torch.cat(pix), "image_grid_thw": torch.cat(grids)}


def agent_row(prompt_parts: list, response_parts: list) -> VlmRow:
    """A multi-turn agent's row whose response may hold images too (a tool that returns an image):
    ``prompt_parts`` / ``response_parts`` as :func:`prompt_with_media`'s ``parts`` -> a :class:`VlmRow` whose media
    dict holds the prompt's images, then the response's, in placeholder order (as the Qwen-VL processors return a
    whole conversation's; None without images)."""
    prompt, pm = prompt_with_media(prompt_parts)
    response, rm = prompt_with_media(response_parts)
    parts = [m for m in (pm, rm) if m is not None]
    media = {k: torch.cat([m[k] for m in parts]) for k in ("pixel_values", "image_grid_thw")} if parts else None
    return VlmRow(prompt, response, media)


def vlm_batch(rows: list) -> dict:
    """verl's layout of ``rows`` (:class:`VlmRow`): ``input_ids [B, S]`` (left-padded prompts, right-padded
    responses, pad 0), ``attention_mask [B, S]``, ``responses [B, R]``, and ``media`` (the per-row dicts)."""
    Pw = max(len(r.prompt) for r in rows)
    R = max(1, max(len(r.response) for r in rows))
    B = len(rows)
    ids = torch.zeros(B, Pw + R, dtype=torch.long)
    am = torch.zeros(B, Pw + R, dtype=torch.long)
    for b, r in enumerate(rows):
        p = len(r.prompt)
        ids[b, Pw - p:Pw] = torch.tensor(r.prompt)
        am[b, Pw - p:Pw] = 1
        if r.response:
            ids[b, Pw:Pw + len(r.response)] = torch.tensor(r.response)
            am[b, Pw:Pw + len(r.response)] = 1
    return {"input_ids": ids, "attention_mask": am, "responses": ids[:, Pw:], "media": [r.media for r in rows]}


def ordinary_vlm_logprobs(model, rows: list) -> list:
    """The oracle: each row alone through the model's own forward (its media, its positions from the model's
    ``get_rope_index``, its default attention) -> per row the log-probs ``[r_b]`` of its response tokens."""
    from zorro_verl.integrations.transformers.vision import rope_positions

    out = []
    for r in rows:
        ids = torch.tensor([r.prompt + r.response])
        media = r.media or {}
        pos = rope_positions(model, ids, None, [media])
        logits = model(input_ids=ids, position_ids=pos, use_cache=False, **media).logits[0].float() \
            if model.dtype != torch.float64 else model(input_ids=ids, position_ids=pos, use_cache=False,
                                                       **media).logits[0]
        p, n = len(r.prompt), len(r.response)
        lp = torch.log_softmax(logits[p - 1:p + n - 1], -1)
        out.append(lp.gather(-1, ids[0, p:p + n, None])[:, 0])
    return out
