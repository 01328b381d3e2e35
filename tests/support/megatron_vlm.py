"""A tiny Qwen2.5-VL checkpoint and verl GRPO batches with images for the Megatron engine tests (never shipped;
tests/integrations/megatron/test_engine_vlm.py, docs/design/megatron.md "Vision-language models").

Megatron-Bridge 0.6.2's ``Qwen25VLBridge`` never reads the checkpoint's M-RoPE sections: its provider keeps
Qwen2.5-VL's own ``mrope_section = [16, 24, 24]`` (64 rotary frequencies), so the tiny language model has head
dim 128 (hidden 256, 2 query heads, 1 KV group) and the checkpoint states the same sections. The vision tower and the
batches are those of tests/support/verl_vlm.py (patch 2, merge 2, window attention then one full block; 4 prompts:
two with the same tokens and different pixels, one with two images of different sizes, one text-only).
No CPU stand-in is needed beyond tests/support/megatron_bridge_cpu.py (the bridge's local layer spec, B1): the
vision tower is transformers' own module, the language model megatron's ``GPTModel`` with ``position_embedding_type
= "mrope"``.
"""

from __future__ import annotations

import torch

__all__ = ["tiny_qwen25vl_config", "save_tiny_qwen25vl", "make_vlm_batch", "hf_vlm_log_probs"]


def tiny_qwen25vl_config():
    """:func:`tests.support.verl_vlm.tiny_vlm_config` ("qwen2_5_vl") with the language model the bridge can run: hidden
    256, 2 heads of dim 128 in 1 KV group, intermediate 256, M-RoPE sections ``[16, 24, 24]``; the vision tower's
    output width 256."""
    import transformers as T

    from tests.support.verl_vlm import tiny_vlm_config

    cfg = tiny_vlm_config("qwen2_5_vl").to_dict()
    text, vision = cfg["text_config"], cfg["vision_config"]
    text.update(hidden_size=256, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [16, 24, 24]})
    text.pop("rope_scaling", None)
    vision.update(out_hidden_size=256)
    keep = {k: cfg[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id",
                                "tie_word_embeddings")}
    return T.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **keep)


def save_tiny_qwen25vl(path: str) -> str:
    """Save a randomly initialised ``Qwen2_5_VLForConditionalGeneration`` of :func:`tiny_qwen25vl_config` (fp32,
    seed 0) at ``path``; weights redrawn at ``1/sqrt(fan_in)`` and 1-D parameters offset, as
    :func:`tests.support.verl_vlm.tiny_vlm_model` (the images move the log-probs by O(1)), the LM head halved
    (log-probs above -8)."""
    import transformers as T

    cfg = tiny_qwen25vl_config()
    cfg.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    torch.manual_seed(0)
    model = T.Qwen2_5_VLForConditionalGeneration._from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) / p[0].numel() ** 0.5)
            else:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
        # a head at half that scale keeps every log-prob above -8, the magnitude test_engine.py's fp32 tolerances are
        # set for (one fp32 ulp there <= 4.8e-7); the images still move the log-probs by O(1)
        model.lm_head.weight.mul_(0.5)
    model.save_pretrained(path)
    return path


def make_vlm_batch(config, *, dynamic: bool, seed: int = 0, n: int = 3, micro_batch: int = 4,
                   max_tokens: int = 160):
    """A jagged GRPO batch with images as verl 0.9.1's trainer hands it to the engine
    (:func:`tests.support.verl_vlm.vlm_base_batch`: 4 prompts x ``n`` rollouts, rows shuffled, per-row
    ``multi_modal_inputs`` and ``position_ids [B, 4, S]``; then ``left_right_2_no_padding`` and verl's non-tensor
    settings)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    from tests.support.verl_vlm import vlm_base_batch, with_mm_stack

    base = with_mm_stack(vlm_base_batch(config, n=n, seed=seed))
    P = base["input_ids"].shape[1] - base["responses"].shape[1]
    fields = dict(base)
    fields["prompts"] = base["input_ids"][:, :P]
    td = left_right_2_no_padding(tu.get_tensordict(fields))
    tu.assign_non_tensor(td, temperature=1.0, calculate_entropy=True, use_dynamic_bsz=dynamic,
                         micro_batch_size_per_gpu=micro_batch, max_token_len_per_gpu=max_tokens,
                         global_batch_size=base["input_ids"].shape[0], use_fused_kernels=False)
    return td


def hf_vlm_log_probs(ckpt: str, td) -> torch.Tensor:
    """transformers' own ``Qwen2_5_VLForConditionalGeneration`` (fp32, sdpa) on each row of ``td`` alone (its
    images and ``mm_token_type_ids``, as the processor returns them: the model's forward computes the 3-D
    positions): the response tokens' log-probs ``[N]`` in row order."""
    import transformers as T

    from zorro_verl.integrations.verl.v09.batching import row_lengths

    model = T.Qwen2_5_VLForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32,
                                                                 attn_implementation="sdpa").eval()
    p, r = row_lengths(td)
    out = []
    with torch.no_grad():
        for b in range(len(p)):
            if r[b] == 0:
                continue
            ids = td["input_ids"][b][None]
            mm = getattr(td["multi_modal_inputs"][b], "data", td["multi_modal_inputs"][b]) or {}
            kw = {k: mm[k] for k in ("pixel_values", "image_grid_thw") if k in mm}
            # what the processor returns beside the ids: transformers' forward reads the placeholders' types from it
            kw["mm_token_type_ids"] = (ids == model.config.image_token_id).int()
            logp = torch.log_softmax(model(input_ids=ids, use_cache=False, **kw).logits[0].float(), -1)
            out.append(logp[p[b] - 1:p[b] + r[b] - 1].gather(-1, ids[0, p[b]:p[b] + r[b], None])[:, 0])
    return torch.cat(out)
