"""Vision-language (VLM) test harness for the verl 0.9 engine on CPU: tiny Qwen-VL checkpoints built offline, GRPO
batches in exactly the layout verl's trainer hands the engine, and an independent per-row Hugging Face oracle.

Families (:data:`FAMILIES`): ``qwen2_5_vl`` (Qwen2.5-VL), ``qwen3_vl`` (Qwen3-VL, deepstack), ``qwen3_vl_moe``
(Qwen3-VL-MoE), ``qwen3_5`` (Qwen3.5: gated delta-net + full attention, with its vision tower).

How verl 0.9.1 builds a VLM batch (what :func:`make_vlm_engine_batch` reproduces):

* the agent loop (``verl/experimental/agent_loop/agent_loop.py``, ``_agent_loop_postprocess``) left-pads the prompt
  and right-pads the response of each rollout, runs the processor once per rollout on the decoded text + images
  (``_compute_multi_modal_inputs``: ``pixel_values [N_patches, C*T*P*P]``, ``image_grid_thw [n_images, 3]``, plus
  ``images_seqlens``), and computes ``position_ids [1, 4, P+R]`` (``_compute_position_ids``): row 0 the text
  positions (``arange`` over valid tokens, 1 on pads), rows 1..3 the M-RoPE (t, h, w) rows from the *model class's*
  ``get_rope_index`` bound to the processor (``verl.utils.tokenizer.hf_processor``: Qwen2_5_VLModel for
  ``Qwen2_5_VLProcessor``, Qwen3VLModel for ``Qwen3VLProcessor``, which Qwen3-VL, Qwen3-VL-MoE and Qwen3.5 use);
  the processor's ``mm_token_type_ids`` is popped there and rebuilt from the image / video token ids.
* ``multi_modal_inputs`` is a per-row dict (``{}`` for an image-free row) in the non-tensor batch; the trainer
  (``DataProto.to_tensordict``) makes it a ``NonTensorStack`` of ``NonTensorData(dict)``, and
  ``left_right_2_no_padding`` makes ``input_ids`` jagged ``[B, j]`` and ``position_ids`` jagged ``[B, 4, j]``
  (ragged dim 2).

Test-only patches (nothing in the package; verl itself is never edited):

* :func:`original_hf_forwards` / :func:`reset_verl_patches`: verl's ``apply_monkey_patch`` replaces methods **on
  transformers' classes** (process-wide) when an engine is built, and never undoes it; the oracle needs
  transformers' own forward, and an engine built with ``use_remove_padding=False`` after one built with ``True``
  would otherwise keep the first one's attention patch.
* :func:`cpu_stock_vlm_kernels`: what verl's stock remove-padding path needs from GPU libraries on a CPU host
  (Qwen2.5-VL: flash-attn; Qwen3.5: flash-linear-attention's ``cu_seqlens`` support), see there.
"""

from __future__ import annotations

import contextlib
import importlib
import types
from typing import Optional

import torch

__all__ = ["FAMILIES", "VOCAB", "IMAGE_TOKEN", "VIDEO_TOKEN", "VISION_START", "VISION_END", "tiny_vlm_config",
           "tiny_vlm_model", "tiny_vlm_checkpoint", "patch_dim", "rope_processor", "verl_position_ids",
           "vlm_prompts", "make_vlm_engine_batch", "batch_rows", "original_hf_forwards", "hf_row_logits",
           "hf_reference", "reference_loss_grads", "reset_verl_patches", "cpu_stock_vlm_kernels",
           "oracle_model"]

#: VLM families the harness builds (all build from a tiny config in transformers 5.10.4).
FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5")
#: Vocabulary of the tiny models; the last ids are the vision special tokens, text tokens are drawn from
#: ``[1, TEXT_VOCAB)``.
VOCAB = 128
IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 120, 121, 122, 123
TEXT_VOCAB = 120

_CLASSES = {"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration", "qwen3_vl": "Qwen3VLForConditionalGeneration",
            "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration", "qwen3_5": "Qwen3_5ForConditionalGeneration"}


def tiny_vlm_config(family: str, *, vocab_size: int = VOCAB):
    """A tiny config of ``family`` built offline: text hidden 32, 4 heads (2 KV heads), 2 layers; vision tower of
    depth 2, hidden 32, 2 heads, ``patch_size`` 2, ``temporal_patch_size`` 2, ``spatial_merge_size`` 2 (an image of
    grid ``(1, h, w)`` has ``h*w`` patches of ``3*2*2*2 = 24`` values and ``h*w/4`` placeholder tokens). M-RoPE
    sections sum to half the rotary dimension ([2, 1, 1]); Qwen3-VL / Qwen3.5 interleaved as their checkpoints."""
    import transformers as T

    if family not in FAMILIES:
        raise ValueError(f"family: expected one of {FAMILIES}, got {family!r}.")
    tokens = dict(image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START,
                  vision_end_token_id=VISION_END, tie_word_embeddings=False)
    text = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, attention_dropout=0.0,
                bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=2, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=32)
    if family == "qwen2_5_vl":
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
        # window attention over 2x2 merged tokens (window_size / merge / patch), the last block full attention
        vision.update(window_size=8, fullatt_block_indexes=[1])
        return T.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **tokens)
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1], "mrope_interleaved": True}
    vision["num_position_embeddings"] = 16  # a 4x4 grid of learned position embeddings, interpolated
    if family in ("qwen3_vl", "qwen3_vl_moe"):
        text.update(head_dim=8, rope_parameters=rope)
        vision["deepstack_visual_indexes"] = [0, 1]  # both vision blocks feed both text layers
        if family == "qwen3_vl":
            return T.Qwen3VLConfig(text_config=text, vision_config=vision, **tokens)
        text.update(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1)
        return T.Qwen3VLMoeConfig(text_config=text, vision_config=vision, **tokens)
    # qwen3_5: one gated delta-net layer, then one (gated) full-attention layer with partial rotary (8 of 16 dims)
    text.update(head_dim=16, layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4,
                linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                rope_parameters={**rope, "partial_rotary_factor": 0.5})
    return T.Qwen3_5Config(text_config=text, vision_config=vision, **tokens)


def patch_dim(config) -> int:
    """Values per vision patch (a ``pixel_values`` row): ``in_channels * temporal_patch_size * patch_size**2``."""
    v = config.vision_config
    return v.in_channels * v.temporal_patch_size * v.patch_size ** 2


def tiny_vlm_model(family: str, *, dtype: torch.dtype = torch.float32, seed: int = 0,
                   attn_implementation: str = "sdpa"):
    """A randomly initialised ``*ForConditionalGeneration`` of :func:`tiny_vlm_config`, deterministic per ``seed``.

    Weights are re-drawn at ``1/sqrt(fan_in)`` scale (HF's 0.02 init makes a tiny model's outputs nearly independent
    of the image, so a harness error in the pixels would hide below fp32 tolerances) and 1-D parameters get a random
    offset, so the vision tower moves the log-probs by O(0.1-1)."""
    import transformers as T

    cfg = tiny_vlm_config(family)
    torch.manual_seed(seed)
    model = getattr(T, _CLASSES[family])._from_config(cfg, dtype=dtype, attn_implementation=attn_implementation)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype) / fan_in ** 0.5)
            else:
                p.add_(0.1 * torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype))
    return model.eval()


def tiny_vlm_checkpoint(tmpdir, family: str, *, seed: int = 0) -> str:
    """Save :func:`tiny_vlm_model` (fp32) as an HF checkpoint directory under ``tmpdir``; returns its path.

    verl's ``HFModelConfig(path=..., load_tokenizer=False)`` needs only ``config.json`` (with one ``architectures``
    entry, written by ``save_pretrained``) and the weights: the processor / tokenizer are loaded only with
    ``load_tokenizer=True``, and the engine picks ``AutoModelForImageTextToText`` from the config type
    (``verl.utils.model.get_hf_auto_model_class``). No ``preprocessor_config.json`` is written."""
    import os

    path = os.path.join(str(tmpdir), f"tiny_{family}")
    tiny_vlm_model(family, seed=seed).save_pretrained(path)
    return path


# ---------------------------------------------------------------------------------------------------------------
# position ids as verl computes them


def rope_processor(config):
    """A stand-in for the processor verl's ``hf_processor`` returns, as far as position ids go: ``config`` set on it
    and the model class's ``get_rope_index`` / ``get_vision_position_ids`` bound to it, the class chosen by the
    processor class exactly as ``verl/utils/tokenizer/tokenizer.py`` (``hf_processor``) does (Qwen3.5 and Qwen3-VL-MoE
    use ``Qwen3VLProcessor``, hence ``Qwen3VLModel.get_rope_index``)."""
    import transformers as T

    model_class = {"qwen2_vl": T.Qwen2VLModel, "qwen2_5_vl": T.Qwen2_5_VLModel, "qwen3_vl": T.Qwen3VLModel,
                   "qwen3_vl_moe": T.Qwen3VLModel, "qwen3_5": T.Qwen3VLModel,
                   "qwen3_5_moe": T.Qwen3VLModel}[config.model_type]
    proc = types.SimpleNamespace(config=config, image_token_id=config.image_token_id,
                                 video_token_id=config.video_token_id)
    proc.get_rope_index = types.MethodType(model_class.get_rope_index, proc)
    if hasattr(model_class, "get_vision_position_ids"):
        proc.get_vision_position_ids = types.MethodType(model_class.get_vision_position_ids, proc)
    return proc


def verl_position_ids(config, input_ids: torch.Tensor, attention_mask: torch.Tensor, mm_inputs: dict) -> torch.Tensor:
    """verl's own ``AgentLoopWorker._compute_position_ids`` on one padded row: ``input_ids`` / ``attention_mask``
    ``[1, S]`` int64, ``mm_inputs`` the processor output without ids / mask (its ``mm_token_type_ids`` is popped, as
    verl does). Returns ``[1, 4, S]`` int64: text positions, then the 3 M-RoPE rows."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    worker = types.SimpleNamespace(processor=rope_processor(config))
    return AgentLoopWorker._compute_position_ids(worker, input_ids, attention_mask, mm_inputs)


# ---------------------------------------------------------------------------------------------------------------
# batches


def vlm_prompts(config, seed: int = 0) -> list:
    """The prompts of :func:`make_vlm_engine_batch`: a list of ``(tokens: list[int], grids: list[(t, h, w)],
    pixel_values: Tensor | None)``:

    0. one image ``(1, 4, 4)`` (4 placeholder tokens) between text;
    1. **the same tokens** as 0 (same text, same image size, so the same placeholders) but different pixels;
    2. two images, ``(1, 4, 6)`` and ``(1, 6, 4)`` (6 placeholders each), text before, between and after;
    3. no image (text only).
    """
    gen = torch.Generator().manual_seed(seed)
    text = lambda n: torch.randint(1, TEXT_VOCAB, (n,), generator=gen).tolist()  # noqa: E731
    merge = config.vision_config.spatial_merge_size

    def image(grid):
        t, h, w = grid
        return [VISION_START] + [IMAGE_TOKEN] * (t * h * w // merge ** 2) + [VISION_END]

    def pixels(grids):
        return torch.randn(sum(t * h * w for t, h, w in grids), patch_dim(config), generator=gen)

    g0 = [(1, 4, 4)]
    a, b = text(5), text(3)
    p0 = (a + image(g0[0]) + b, g0, pixels(g0))
    p1 = (list(p0[0]), g0, pixels(g0))
    g2 = [(1, 4, 6), (1, 6, 4)]
    p2 = (text(4) + image(g2[0]) + text(2) + image(g2[1]) + text(3), g2, pixels(g2))
    p3 = (text(9), [], None)
    return [p0, p1, p2, p3]


def make_vlm_engine_batch(config, *, n: int = 3, response_len: int = 6, seed: int = 0, shuffle: bool = True,
                          temperature: float = 1.0, calculate_entropy: bool = True, use_dynamic_bsz: bool = False,
                          micro_batch_size: int = 4, max_token_len: int = 128, use_remove_padding: bool = True,
                          images_seqlens: bool = True, response_images: bool = False):
    """A GRPO VLM batch (TensorDict) exactly as verl 0.9.1's trainer hands it to ``FSDPEngineWithLMHead``:
    :func:`vlm_base_batch` (the padded rows; ``response_images`` as there), then ``DataProto.to_tensordict`` and
    :func:`tests.support.verl_engines.make_engine_batch` (``left_right_2_no_padding``, the engine's non-tensor
    fields, verl's training fields ``old_log_probs`` / ``advantages`` / ``ref_log_prob``)."""
    from tests.support.verl_engines import make_engine_batch

    base = vlm_base_batch(config, n=n, response_len=response_len, seed=seed, shuffle=shuffle,
                          images_seqlens=images_seqlens, response_images=response_images)
    return make_engine_batch(base=with_mm_stack(base), temperature=temperature, calculate_entropy=calculate_entropy,
                             use_dynamic_bsz=use_dynamic_bsz, micro_batch_size=micro_batch_size,
                             max_token_len=max_token_len, use_remove_padding=use_remove_padding)


def with_mm_stack(base: dict) -> dict:
    """``base`` (:func:`vlm_base_batch`, or rows of it) with its ``multi_modal_inputs`` list as the
    ``NonTensorStack`` verl's batches carry (and without ``uid``)."""
    from tensordict.tensorclass import NonTensorData, NonTensorStack

    out = {k: v for k, v in base.items() if k != "uid"}
    out["multi_modal_inputs"] = NonTensorStack.from_list([NonTensorData(d) for d in base["multi_modal_inputs"]])
    return out


def vlm_base_batch(config, *, n: int = 3, response_len: int = 6, seed: int = 0, shuffle: bool = True,
                   images_seqlens: bool = True, response_images: bool = False) -> dict:
    """The padded rows of :func:`make_vlm_engine_batch`: :func:`vlm_prompts` x ``n`` rollouts (``B = 4n`` rows),
    rows shuffled (siblings interleaved, as after ``_balance_batch``) with ``shuffle``; responses of random length in
    ``[1, response_len]`` with one empty response (prompt 0) and one 1-token response (prompt 2).

    Per row, as the agent loop does: prompt left-padded / response right-padded, ``position_ids [4, S]`` from
    :func:`verl_position_ids` on the padded row, ``multi_modal_inputs`` a dict ``{pixel_values [N, 24] fp32,
    image_grid_thw [n_img, 3] int64, images_seqlens [n_img] int64}`` (its own copy per rollout; ``{}`` for the
    image-free prompt; ``images_seqlens=False`` leaves that key out). Returns the padded batch with training fields
    (:func:`zorro_verl.testing.batch_from_rows`), ``position_ids [B, 4, S]`` and ``multi_modal_inputs`` (a list of
    ``B`` dicts) and ``uid`` (a list: each row's prompt index).

    ``response_images``: a multi-turn agent's batch whose tool returns an image inside the response: rollouts 1 and 2
    of each prompt answer ``[2 text tokens of the prompt] <tool image> [1-3 random tokens]``; rollout 1's image is X
    (one ``(1, 4, 4)`` image, the same pixels in every such row, each row its own tensor), rollout 2's is X for
    prompts 0 and 2 (two rows of a group with the same response start and tool image) and its own random ``(1, 4, 6)``
    image for prompts 1 and 3 (different tool images in a group; prompt 3's rows have images in the response only).
    The tool's tokens (``<vision_start> <image>... <vision_end>``) get ``response_mask`` 0, as the agent loop gives
    tool output; ``multi_modal_inputs`` holds the prompt's images, then the response's, in placeholder order (the
    processor's output for the whole conversation)."""
    from zorro_verl.testing import batch_from_rows

    prompts = vlm_prompts(config, seed=seed)
    gen = torch.Generator().manual_seed(seed + 7)
    rows = []  # (prompt index, response tokens)
    for g in range(len(prompts)):
        for _ in range(n):
            r = int(torch.randint(1, response_len + 1, (1,), generator=gen))
            rows.append([g, torch.randint(1, TEXT_VOCAB, (r,), generator=gen).tolist()])
    rows[0][1] = []  # an empty response (prompt 0)
    rows[2 * n][1] = rows[2 * n][1][:1]  # a 1-token response (prompt 2)
    tool = [None] * len(rows)  # per row: (grid, pixels) of its tool image
    masks = [[1] * len(r) for _, r in rows]
    if response_images:
        merge = config.vision_config.spatial_merge_size
        x = torch.randn(16, patch_dim(config), generator=gen)
        for g in range(len(prompts)):
            pre = torch.randint(1, TEXT_VOCAB, (2,), generator=gen).tolist()
            for k in (1, 2):
                grid = (1, 4, 4) if k == 1 or g % 2 == 0 else (1, 4, 6)
                pixels = x.clone() if grid == (1, 4, 4) else torch.randn(24, patch_dim(config), generator=gen)
                span = [VISION_START] + [IMAGE_TOKEN] * (grid[1] * grid[2] // merge ** 2) + [VISION_END]
                tail = torch.randint(1, TEXT_VOCAB, (int(torch.randint(1, 4, (1,), generator=gen)),),
                                     generator=gen).tolist()
                b = g * n + k
                rows[b][1] = pre + span + tail
                masks[b] = [1] * len(pre) + [0] * len(span) + [1] * len(tail)
                tool[b] = (grid, pixels)
    if shuffle:
        perm = torch.randperm(len(rows), generator=gen).tolist()
        rows, tool, masks = [rows[i] for i in perm], [tool[i] for i in perm], [masks[i] for i in perm]
    base = batch_from_rows([(prompts[g][0], r) for g, r in rows], response_masks=masks, include_training_fields=True,
                           seed=seed)
    positions, mm = [], []
    for b, (g, _) in enumerate(rows):
        _, grids, pixels = prompts[g]
        if tool[b] is not None:  # the conversation's images: the prompt's, then the tool's
            grids = list(grids) + [tool[b][0]]
            pixels = tool[b][1] if pixels is None else torch.cat([pixels, tool[b][1]])
        ids, mask = base["input_ids"][b:b + 1], base["attention_mask"][b:b + 1]
        # the processor returns mm_token_type_ids; verl's position code pops it and rebuilds it from the ids
        inputs = {"mm_token_type_ids": torch.zeros_like(ids)}
        if grids:
            grid = torch.tensor(grids, dtype=torch.long)
            inputs.update(pixel_values=pixels.clone(), image_grid_thw=grid)
        positions.append(verl_position_ids(config, ids, mask, inputs))
        inputs.pop("mm_token_type_ids", None)
        if grids and images_seqlens:  # verl: repeat_interleave(h * w, t) per image
            inputs["images_seqlens"] = torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0])
        mm.append(inputs)
    base["position_ids"] = torch.cat(positions, dim=0)  # [B, 4, S]
    base["multi_modal_inputs"] = mm
    base["uid"] = [g for g, _ in rows]
    return base


def batch_rows(td) -> list:
    """Per row of an engine batch: ``(input_ids [S_b] int64, prompt_len, response_len, position_ids [4, S_b],
    multi_modal_inputs dict)``."""
    p_lens = td["prompts"].offsets().diff().tolist() if td["prompts"].is_nested else None
    r_lens = td["responses"].offsets().diff().tolist() if td["responses"].is_nested else None
    if p_lens is None:  # padded prompts / responses with attention_mask (make_engine_batch keeps them padded)
        P = td["prompts"].shape[1]
        am = td["attention_mask"]
        p_lens, r_lens = am[:, :P].sum(1).tolist(), am[:, P:].sum(1).tolist()
    out = []
    ids, pos = td["input_ids"].unbind(), td["position_ids"].unbind()
    for b in range(len(p_lens)):
        mm = td["multi_modal_inputs"][b]
        mm = mm.data if hasattr(mm, "data") else mm
        out.append((ids[b], p_lens[b], r_lens[b], pos[b], dict(mm or {})))
    return out


# ---------------------------------------------------------------------------------------------------------------
# the Hugging Face oracle

#: What verl's ``apply_monkey_patch`` (``verl/models/transformers/monkey_patch.py``) assigns on transformers'
#: classes for the Qwen-VL families, by module: class.attribute. Captured at import of this module.
_VERL_PATCHED = {
    "transformers.models.qwen2_vl.modeling_qwen2_vl": [
        "Qwen2VLModel.forward", "Qwen2VLForConditionalGeneration.forward", "Qwen2VLAttention.forward",
        "Qwen2VLTextModel.forward"],
    "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl": [
        "Qwen2_5_VLModel.forward", "Qwen2_5_VLForConditionalGeneration.forward", "Qwen2_5_VLAttention.forward",
        "Qwen2_5_VLTextModel.forward"],
    "transformers.models.qwen3_vl.modeling_qwen3_vl": [
        "Qwen3VLModel.forward", "Qwen3VLForConditionalGeneration.forward", "Qwen3VLTextModel.forward",
        "Qwen3VLVisionModel.fast_pos_embed_interpolate"],
    "transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe": [
        "Qwen3VLMoeModel.forward", "Qwen3VLMoeForConditionalGeneration.forward", "Qwen3VLMoeTextModel.forward",
        "Qwen3VLMoeVisionModel.fast_pos_embed_interpolate", "Qwen3VLMoeTextSparseMoeBlock.forward"],
    "transformers.models.qwen3_5.modeling_qwen3_5": [
        "Qwen3_5Model.forward", "Qwen3_5ForConditionalGeneration.forward", "Qwen3_5TextModel.forward",
        "Qwen3_5DecoderLayer.forward", "Qwen3_5GatedDeltaNet.forward", "Qwen3_5VisionModel.fast_pos_embed_interpolate"],
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe": [
        "Qwen3_5MoeModel.forward", "Qwen3_5MoeForConditionalGeneration.forward", "Qwen3_5MoeTextModel.forward",
        "Qwen3_5MoeDecoderLayer.forward", "Qwen3_5MoeGatedDeltaNet.forward",
        "Qwen3_5MoeVisionModel.fast_pos_embed_interpolate"],
}


def _capture_originals() -> dict:
    out = {}
    for mod_name, attrs in _VERL_PATCHED.items():
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:  # a transformers without this family: nothing of it to restore
            continue
        for spec in attrs:
            cls_name, attr = spec.split(".")
            cls = getattr(mod, cls_name, None)
            fn = None if cls is None else cls.__dict__.get(attr)
            if fn is None:
                continue
            if not getattr(fn, "__module__", "").startswith("transformers."):
                raise RuntimeError(f"{cls_name}.{attr} is already replaced ({fn.__module__}) when tests.support."
                                   "verl_vlm is imported: import it before building any verl engine of a VLM.")
            out[(cls, attr)] = fn
    return out


_ORIGINALS = _capture_originals()


@contextlib.contextmanager
def original_hf_forwards():
    """Within the block, every method verl's ``apply_monkey_patch`` replaces on the Qwen-VL classes is transformers'
    own again (verl patches classes, so an engine built earlier in this process changes every instance); the
    patched methods are put back on exit."""
    current = {(cls, attr): cls.__dict__[attr] for cls, attr in _ORIGINALS}
    try:
        for (cls, attr), fn in _ORIGINALS.items():
            setattr(cls, attr, fn)
        yield
    finally:
        for (cls, attr), fn in current.items():
            setattr(cls, attr, fn)


def reset_verl_patches() -> None:
    """Put transformers' own methods back on every class verl's ``apply_monkey_patch`` changes for the Qwen-VL
    families (call before building an engine, so that it runs exactly the patches its own config asks for)."""
    for (cls, attr), fn in _ORIGINALS.items():
        setattr(cls, attr, fn)


def _cpu_flash_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, dropout_p=0.0,
                      softmax_scale=None, causal=True, **kwargs):
    """flash-attn's ``flash_attn_varlen_func`` on CPU: ``q/k/v [T, H, D]`` (same heads: verl repeats KV before),
    causal attention within each ``cu_seqlens`` segment -> ``[T, H, D]``."""
    assert torch.equal(cu_seqlens_q, cu_seqlens_k) and not kwargs.get("window_size"), "self-attention only"
    out = torch.empty_like(q)
    bounds = cu_seqlens_q.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        out[s:e] = torch.nn.functional.scaled_dot_product_attention(
            q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1), dropout_p=dropout_p,
            is_causal=causal, scale=softmax_scale).transpose(0, 1)
    return out


def _cpu_flash_forward(query_states, key_states, value_states, attention_mask, query_length, is_causal=True,
                       dropout=0.0, softmax_scale=None, **kwargs):
    """transformers' ``_flash_attention_forward`` on CPU for verl's one-sequence case (``[B, S, H, D]``, no mask)."""
    assert attention_mask is None, "verl's remove-padding path passes no attention mask"
    return torch.nn.functional.scaled_dot_product_attention(
        query_states.transpose(1, 2), key_states.transpose(1, 2), value_states.transpose(1, 2), dropout_p=dropout,
        is_causal=is_causal, scale=softmax_scale).transpose(1, 2)


@contextlib.contextmanager
def cpu_stock_vlm_kernels():
    """Test-only stand-ins (on verl's module globals, undone on exit) for the GPU kernels verl 0.9.1's STOCK
    remove-padding path calls for two VLM families, so that it runs on a CPU host and computes what it computes
    on a GPU:

    * Qwen2.5-VL / Qwen2-VL: with ``use_remove_padding`` verl replaces the text attention by
      ``verl.models.transformers.qwen2_vl.qwen2_vl_attn_forward``, which always calls flash-attn
      (``flash_attn_varlen_func`` for packed rows, transformers' ``_flash_attention_forward`` for one row) and reads
      module globals defined only when flash-attn is installed (``NameError: _flash_use_top_left_mask`` on CPU).
      Stand-ins: per-segment causal SDPA. Its ``fa_peft_integration_check(..., target_dtype=bfloat16)`` casts fp32
      q/k/v to bf16 for flash (so an fp32 run's Qwen2.5-VL attention is bf16 on a GPU); the stand-in keeps fp32
      (identity), so the comparison with the fp32 oracle is at fp32 tolerance.
    * Qwen3.5: ``verl.models.transformers.qwen3_5._packed_chunk_gated_delta_rule`` passes ``cu_seqlens`` to the
      delta-rule kernel when ``_call_accepts_kwarg(fn, "cu_seqlens")``, which is True for any ``**kwargs`` function;
      without flash-linear-attention the kernel is transformers' ``torch_chunk_gated_delta_rule(..., **kwargs)``,
      which ignores ``cu_seqlens``: the recurrent state then runs across packed rows (measured: log-prob errors up
      to 0.17 on every row but the first of a micro-batch). The stand-in makes that check False for the torch
      kernel, so verl's own per-segment loop (its fallback for kernels without ``cu_seqlens``) runs.
    """
    from verl.models.transformers import qwen2_vl, qwen3_5

    saved2 = {k: qwen2_vl.__dict__.get(k, _MISSING) for k in _QWEN2_VL_FLASH}
    saved35 = qwen3_5._call_accepts_kwarg
    try:
        qwen2_vl.flash_attn_varlen_func = _cpu_flash_varlen
        qwen2_vl._flash_attention_forward = _cpu_flash_forward
        qwen2_vl.fa_peft_integration_check = lambda q, k, v, target_dtype=None: (q, k, v)
        qwen2_vl._flash_supports_window_size = False
        qwen2_vl._flash_supports_deterministic = False
        qwen2_vl._flash_use_top_left_mask = False

        def accepts(fn, name, _orig=saved35):
            torch_kernel = getattr(fn, "__name__", "") == "torch_chunk_gated_delta_rule"
            if torch_kernel and name in ("cu_seqlens", "cu_seqlens_cpu"):
                return False  # transformers' torch kernel takes **kwargs but has no varlen support
            return _orig(fn, name)

        qwen3_5._call_accepts_kwarg = accepts
        yield
    finally:
        for k, v in saved2.items():
            if v is _MISSING:
                qwen2_vl.__dict__.pop(k, None)
            else:
                setattr(qwen2_vl, k, v)
        qwen3_5._call_accepts_kwarg = saved35


_MISSING = object()
_QWEN2_VL_FLASH = ("flash_attn_varlen_func", "_flash_attention_forward", "fa_peft_integration_check",
                   "_flash_supports_window_size", "_flash_supports_deterministic", "_flash_use_top_left_mask")


def oracle_model(ckpt: str, dtype: torch.dtype = torch.float64):
    """The checkpoint as transformers loads it, for the oracle: SDPA attention, ``dtype`` (default fp64), eager
    MoE experts (``grouped_mm`` has no fp64 kernel), eval mode."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(ckpt, dtype=dtype, attn_implementation="sdpa",
                                                        experts_implementation="eager")
    return model.eval()


def hf_row_logits(model, input_ids: torch.Tensor, mm: dict, *, check_positions: Optional[torch.Tensor] = None):
    """transformers' own forward of one row alone (``input_ids [S]`` int64, its own ``pixel_values`` /
    ``image_grid_thw``), positions from the model's own ``get_rope_index`` (``mm_token_type_ids`` from the image
    token), no padding, no packing. Returns ``logits [S, V]``. ``check_positions [4, S]``: the batch's positions for
    this row, asserted equal to the model's (rows 1..3) and to ``arange`` (row 0)."""
    cfg = model.config
    ids = input_ids[None]
    mm_types = (ids == cfg.image_token_id).long() + 2 * (ids == cfg.video_token_id).long()
    kwargs = {}
    grid = mm.get("image_grid_thw")
    if grid is not None:
        kwargs.update(pixel_values=mm["pixel_values"], image_grid_thw=grid)
    with original_hf_forwards():
        pos, _ = model.model.get_rope_index(ids, mm_token_type_ids=mm_types, image_grid_thw=grid)
        if check_positions is not None:
            assert torch.equal(check_positions[1:], pos[:, 0]), (check_positions, pos)
            assert torch.equal(check_positions[0], torch.arange(ids.shape[1])), check_positions
        out = model(input_ids=ids, position_ids=pos, use_cache=False, **kwargs)
    return out.logits[0]


def hf_reference(model, td, *, temperature: float = 1.0, check_positions: bool = True) -> dict:
    """The oracle of an engine batch ``td``: per row alone, :func:`hf_row_logits` / ``temperature`` ->
    ``log_probs`` / ``entropy`` ``[B, Rmax]`` of the response tokens in the model's dtype (at least fp32; zeros on
    pads; differentiable w.r.t. the model's parameters when grad is enabled). An fp64 model gives an oracle whose
    own rounding is far below the fp32 engine's (an fp32 oracle of Qwen3.5 is ~1e-5 off in its vision gradients:
    the chunked delta rule in fp32)."""
    rows = batch_rows(td)
    R = max(1, max(r for _, _, r, _, _ in rows))
    logps, ents = [], []
    for ids, p, r, pos, mm in rows:
        logits = hf_row_logits(model, ids, mm, check_positions=pos if check_positions else None)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp64 for an fp64 oracle
        logits = logits[p - 1:p + r - 1] / temperature  # predict-next: position t-1 predicts token t
        logp_all = torch.log_softmax(logits, dim=-1)
        lp = logp_all.gather(-1, ids[p:p + r, None]).squeeze(-1)
        ent = -(logp_all.exp() * logp_all).sum(-1)
        logps.append(torch.nn.functional.pad(lp, (0, R - r)))
        ents.append(torch.nn.functional.pad(ent, (0, R - r)))
    return {"log_probs": torch.stack(logps), "entropy": torch.stack(ents)}


def reference_loss_grads(model, td, loss_function, *, temperature: float = 1.0) -> tuple:
    """The training step's oracle: :func:`hf_reference` log-probs (with grad) through verl's own policy loss
    (the ``config`` bound in ``loss_function``, e.g. :func:`tests.support.verl_engines.ppo_loss_fn`; normalised
    over the whole batch as the engine's global ``batch_num_tokens`` does, 1 DP rank), backward, and the
    gradients by parameter name. Returns ``(loss, grads)``. (The entropy term of ``ppo_loss`` is left out: its
    coefficient is 0 in :func:`ppo_loss_fn`'s default.)"""
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    cfg = loss_function.keywords["config"]
    assert not cfg.entropy_coeff and not cfg.use_kl_loss, "the reference implements the plain policy loss only"
    model.zero_grad(set_to_none=True)
    with torch.enable_grad():
        ref = hf_reference(model, td, temperature=temperature, check_positions=False)
        mask = td["response_mask"]
        mask = (torch.nested.to_padded_tensor(mask, 0) if mask.is_nested else mask).bool()
        R = ref["log_probs"].shape[1]
        pad = lambda x: (torch.nested.to_padded_tensor(x, 0.0) if x.is_nested else x)[:, :R]  # noqa: E731
        cfg.global_batch_info.update(dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=mask.shape[0],
                                     loss_scale_factor=cfg.loss_scale_factor)
        loss, _ = get_policy_loss_fn(cfg.policy_loss.get("loss_mode", "vanilla"))(
            old_log_prob=pad(td["old_log_probs"]), log_prob=ref["log_probs"], advantages=pad(td["advantages"]),
            response_mask=mask[:, :R], loss_agg_mode=cfg.loss_agg_mode, config=cfg, rollout_is_weights=None)
        loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads
