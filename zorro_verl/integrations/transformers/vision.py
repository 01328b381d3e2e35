"""Vision-language models (Qwen2-VL family: Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5's multimodal model) under zorro
(docs/design/model-step.md "Vision-language models").

The language model runs zorro's split attention on the packed row; the vision tower keeps its own attention (it
attends within each image, bidirectionally) and runs inside the model's own forward on the packed row's media —
each unique prompt's images once (:mod:`zorro_verl.packing.multimodal`). The model receives the packed row's 3-D
rotary positions explicitly, so it never recomputes them from the packed row (where prompts and responses of
different rows follow one another).

Under Ulysses sequence parallelism every rank of the SP group runs the vision tower on the packed row's media (each
unique prompt's once) and merges the features into the embeddings of the whole padded row, as verl's stock engine
does for its rows; :func:`sliced_language_model` then hands the language model the rank's slice of the merged
embeddings, of the 3-D positions and (Qwen3-VL) of the deepstack features. The tower's gradient on each rank comes from
the features its slice holds; FSDP's reduction sums the ranks' parts.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import Optional

import torch

from zorro_verl.packing.multimodal import MEDIA_FIELDS, MediaTokens, check_media_placeholders

__all__ = ["is_multimodal", "sub_attention", "zorro_attention_request", "media_tokens", "rope_positions",
           "token_types", "language_model", "sliced_language_model"]


def _config(model):
    return model.config


def is_multimodal(model) -> bool:
    """Whether ``model`` has a vision tower (``config.vision_config``)."""
    return getattr(_config(model), "vision_config", None) is not None


def sub_attention(model) -> dict:
    """``{sub_config_name: attn_implementation}`` of the model's sub-configs other than the language model's
    (e.g. ``vision_config``), which zorro leaves as they are; empty for a text-only model."""
    cfg = _config(model)
    out = {}
    for key in getattr(cfg, "sub_configs", {}) or {}:
        sub = getattr(cfg, key, None)
        if key != "text_config" and sub is not None:
            out[key] = getattr(sub, "_attn_implementation", None) or "sdpa"
    return out


def zorro_attention_request(model, name: str):
    """The ``set_attn_implementation`` argument that switches the language model (and the root config) to
    ``name`` and keeps every other sub-model's attention: ``name`` itself for a text-only model."""
    subs = sub_attention(model)
    if not subs:
        return name
    return {"": name, "text_config": name, **subs}


def media_tokens(model) -> MediaTokens:
    """The placeholder ids and patch merge of a vision-language model; ``ValueError`` for a text-only one."""
    cfg = _config(model)
    vcfg = getattr(cfg, "vision_config", None)
    if vcfg is None:
        raise ValueError(f"model: {type(model).__name__} has no vision tower (config.vision_config); multimodal "
                         "inputs need a vision-language model.")
    merge = getattr(vcfg, "spatial_merge_size", None)
    if not isinstance(merge, int) or merge < 1:
        raise ValueError(f"model: vision_config.spatial_merge_size is {merge!r}; zorro supports the Qwen2-VL family "
                         "(Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5), whose vision tower merges patches.")
    return MediaTokens(getattr(cfg, "image_token_id", None), getattr(cfg, "video_token_id", None), merge)


def token_types(input_ids: torch.Tensor, tokens: MediaTokens) -> torch.Tensor:
    """``input_ids [B, S]`` -> ``mm_token_type_ids [B, S] int32``: 0 text, 1 image placeholder, 2 video
    placeholder (what the Qwen-VL processors return and ``get_rope_index`` reads)."""
    out = torch.zeros_like(input_ids, dtype=torch.int32)
    for value, kind in ((1, "image"), (2, "video")):
        tid = tokens.token_id(kind)
        if tid is not None:
            out = torch.where(input_ids == tid, value, out)
    return out


def rope_positions(model, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor],
                   media: list) -> torch.Tensor:
    """The rows' 3-D rotary positions as the model computes them for its ordinary forward: ``input_ids [B, S]``,
    ``attention_mask [B, S]`` (or None), ``media[b]`` row ``b``'s inputs -> ``[3, B, S] int64`` (pads: whatever
    ``get_rope_index`` leaves). Used by the lower-level standalone path (``rope_positions`` + ``build_media_plan`` +
    ``zorro_step``), the tests' oracle and the benchmark; verl hands the engine its own.

    Each row's placeholders must match its media (:func:`~zorro_verl.packing.multimodal.check_media_placeholders`,
    ValueError naming the row). ``second_per_grid_ts`` (one value per video of the row, as ``video_grid_thw``'s
    rows; a row without it gets the model's default, 1) is passed where ``get_rope_index`` takes it (Qwen2.5-VL:
    the videos' temporal positions); models whose ``get_rope_index`` does not name it (Qwen3-VL: timestamps in the
    text) ignore it in their own forward, and so does this."""
    inner = getattr(model, "model", model)
    tokens = media_tokens(model)
    check_media_placeholders(input_ids, attention_mask, media, tokens)
    grids = {}
    for kind, (_, grid_field) in MEDIA_FIELDS.items():
        rows = [m[grid_field] for m in media if m and m.get(grid_field) is not None]
        grids[kind] = torch.cat(rows) if rows else None
    extra = {}
    if "second_per_grid_ts" in inspect.signature(inner.get_rope_index).parameters and grids["video"] is not None:
        extra["second_per_grid_ts"] = _seconds_per_grid(media)
    am = torch.ones_like(input_ids) if attention_mask is None else attention_mask.long()
    pos, _ = inner.get_rope_index(input_ids, token_types(input_ids, tokens), image_grid_thw=grids["image"],
                                  video_grid_thw=grids["video"], attention_mask=am, **extra)
    return pos.long()


def _seconds_per_grid(media: list) -> torch.Tensor:
    """The batch's ``second_per_grid_ts [n_videos] float64`` (host), rows in order as ``video_grid_thw``: a row's
    own values, ones for a row with videos and none (the model's default; each row alone gets the same)."""
    out = []
    for b, m in enumerate(media):
        grid = m.get("video_grid_thw") if m else None
        if grid is None:
            continue  # a row without videos: its value (if any) is read by no placeholder
        ts = m.get("second_per_grid_ts")
        n = grid.shape[0]
        ts = torch.ones(n, dtype=torch.float64) if ts is None else \
            torch.as_tensor(ts).detach().to("cpu", torch.float64).reshape(-1)
        if ts.numel() != n:
            raise ValueError(f"media[{b}].second_per_grid_ts: expected one value per video of the row ({n}, as "
                             f"video_grid_thw's rows), got {ts.numel()}.")
        out.append(ts)
    return torch.cat(out)


def language_model(model):
    """The language model of a vision-language ``model`` (the ``language_model`` of the module that owns ``visual``;
    possibly FSDP-wrapped): the module the merged embeddings go into. ``ValueError`` when there is none."""
    for sub in model.modules():
        if hasattr(sub, "visual") and isinstance(getattr(sub, "language_model", None), torch.nn.Module):
            return sub.language_model
    raise ValueError(f"model: {type(model).__name__} has no `language_model` beside its vision tower (`visual`); "
                     "zorro runs the Qwen2-VL family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5) under sequence "
                     "parallelism.")


def _slice_text_inputs(kwargs: dict, start: int, stop: int, padded_len: int) -> dict:
    """The language model's keyword arguments for the slice ``[start, stop)`` of the padded row: ``inputs_embeds
    [1, T_pad, H]`` -> ``[1, L, H]``, ``position_ids [3, 1, T_pad]`` -> ``[3, 1, L]``, and (Qwen3-VL's deepstack)
    ``visual_pos_masks [1, T_pad] bool`` -> ``[1, L]`` with each of ``deepstack_visual_embeds [n_visual, H]`` cut to
    the visual positions the slice holds (two host syncs: the visual counts before and inside the slice)."""
    emb = kwargs.get("inputs_embeds")
    if emb is None or emb.shape[1] != padded_len:
        raise ValueError(f"sequence parallel media: the language model got inputs_embeds of shape "
                         f"{None if emb is None else tuple(emb.shape)}, expected the whole padded row "
                         f"[1, {padded_len}, H] (its model merges the media into the embeddings and then calls it).")
    out = dict(kwargs)
    out["inputs_embeds"] = emb[:, start:stop]
    pos = kwargs.get("position_ids")
    if pos is not None:
        out["position_ids"] = pos[..., start:stop]
    mask = kwargs.get("visual_pos_masks")
    if mask is not None:
        deep = kwargs.get("deepstack_visual_embeds")
        if deep is not None:
            before, inside = (int(n) for n in torch.stack([mask[:, :start].sum(), mask[:, start:stop].sum()]).tolist())
            out["deepstack_visual_embeds"] = [d[before:before + inside] for d in deep]
        out["visual_pos_masks"] = mask[:, start:stop]
    return out


@contextmanager
def sliced_language_model(model, shard):
    """Within the block, ``model``'s language model runs on this sequence-parallel rank's slice of its inputs
    (``shard``: :class:`~zorro_verl.packing.ulysses.UlyssesShard`; :func:`_slice_text_inputs`): a forward pre-hook,
    removed on exit. The model is called on the whole padded row (ids ``[1, T_pad]``, 3-D positions
    ``[3, 1, T_pad]``), so its own code encodes the media and scatters the features at their placeholders first."""
    start, stop = shard.start, shard.start + shard.local_len

    def hook(module, args, kwargs):
        return args, _slice_text_inputs(kwargs, start, stop, shard.padded_len)

    handle = language_model(model).register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()
