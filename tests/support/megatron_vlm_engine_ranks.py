"""The Qwen2.5-VL Megatron checks (tests/integrations/megatron/test_engine_vlm.py): verl 0.9.1's stock Megatron
engine (padded bshd path, megatron's own ``DotProductAttention``, the model computing its own 3-D positions) vs
zorro's, fp32 on the CPU, on a tiny ``Qwen2_5_VLForConditionalGeneration`` checkpoint built by Megatron-Bridge's
``Qwen25VLBridge`` (verl's default builder: a ``Qwen25VLModel``, transformers' vision tower beside megatron's
``GPTModel``) with the bridge's local layer spec (tests/support/megatron_bridge_cpu.py); then zorro's step on an fp64
copy of the model vs the model's own forward on each row. One process (TP = 1). Returns ``{"model", "hf", "step1",
"step2", "images", "prefix", "fp64"}``.

Run as ``python -m tests.support.megatron_vlm_engine_ranks RANK WORLD INIT_FILE CKPT_DIR OUT_JSON``.
"""

from __future__ import annotations

from functools import partial

import torch

from tests.support.multi_rank import rank_main

#: verl's micro-batches for the 12-row batch (fixed: 4 rows each) and the engines' token budget
MICRO_BATCH, MAX_TOKENS = 4, 160


class ImageCounter:
    """Counts the images the vision tower encodes (rows of its ``grid_thw``) through a forward pre-hook."""

    def __init__(self, vlm):
        self.images = 0
        vlm.visual.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
        self.images += int(grid.shape[0])


def _step2(E, V, cfg, stock, zorro) -> dict:
    """A second ``train_batch`` on both engines (after step 1's SGD update): every gradient, the parameters after."""
    for eng in (stock, zorro):
        with eng.train_mode(zero_grad_on_exit=False):
            eng.train_batch(V.make_vlm_batch(cfg, dynamic=False, seed=1, micro_batch=MICRO_BATCH,
                                             max_tokens=MAX_TOKENS), loss_function=E.ppo_loss_fn())
    gs, gz = E.grads(stock), E.grads(zorro)
    ps, pz = dict(E.gpt_of(stock).named_parameters()), dict(E.gpt_of(zorro).named_parameters())
    return {"grad_rel": max(((gz[k] - gs[k]).abs().max() / gs[k].abs().max().clamp_min(1e-30)).item() for k in gs),
            "param_after_step": max((pz[k] - ps[k]).abs().max().item() for k in ps), "n_params": len(gs)}


def _fp64_model(ckpt: str):
    """The checkpoint as a ``Qwen25VLModel`` in fp64, built by Megatron-Bridge as verl builds it (the bridge's
    provider, local layer spec, the checkpoint's weights), no DDP; fp64 kept in transformers' vision tower (its
    RMSNorms and rotary embedding cast to fp32 whatever the dtype: test oracle only, zorro_verl.testing)."""
    import os

    from megatron.bridge import AutoBridge

    from zorro_verl.testing.fp64 import exact_fp64_norms
    from zorro_verl.testing.vlm import exact_fp64_vision

    for var in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):  # recorded by the engines' builds
        os.environ.pop(var, None)
    bridge = AutoBridge.from_hf_pretrained(ckpt)
    provider = bridge.to_megatron_provider(load_weights=False)
    for k, v in dict(gradient_accumulation_fusion=False, masked_softmax_fusion=False, bias_activation_fusion=False,
                     bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
                     use_cpu_initialization=True, cross_entropy_loss_fusion=False, params_dtype=torch.float64,
                     pipeline_dtype=torch.float64, attention_softmax_in_fp32=False, hidden_dropout=0.0,
                     attention_dropout=0.0).items():
        setattr(provider, k, v)
    provider.finalize()
    model = provider.provide(pre_process=True, post_process=True).to(torch.float64)
    bridge.load_hf_weights([model])
    model = model.to(torch.float64)
    exact_fp64_vision()
    exact_fp64_norms(model.visual)
    return model


def _fp64_check(ckpt: str, cfg, V) -> dict:
    """zorro's step (``zorro_gpt_step`` with the packed row's media) on the fp64 model vs the model's own forward on
    each row alone (its images; the model computes its positions): response log-probs and entropy (max abs), every
    parameter's gradient of a fixed random linear loss of the log-probs (max relative, vision tower included), and
    the images the tower encodes in each."""
    from zorro_verl.integrations.megatron import install_zorro_megatron, zorro_gpt_step
    from zorro_verl.integrations.transformers.vision import media_tokens, rope_positions
    from zorro_verl.integrations.verl.v09.batching import _row_media, micro_batch_plan, row_lengths
    from zorro_verl.packing.multimodal import batch_media

    model = _fp64_model(ckpt)
    install_zorro_megatron(model.language_model)
    model.train()  # no dropout in this model (hidden / attention dropout 0): train mode as the engine trains
    counter = ImageCounter(model)
    td = V.make_vlm_batch(cfg, dynamic=False)
    p, r = row_lengths(td)
    coef = torch.randn(int(r.sum()), generator=torch.Generator().manual_seed(3), dtype=torch.float64)

    # the ordinary forward: each row alone, its own images
    lp_ref, ent_ref = [], []
    for b in range(len(p)):
        ids = td["input_ids"][b][None]
        mm = _row_media(td)[b] or {}
        kw = {k: mm[k] for k in ("pixel_values", "image_grid_thw") if k in mm}
        logits = model(input_ids=ids, attention_mask=None, **kw)  # [1, S, V]
        logp = torch.log_softmax(logits[0], -1)[p[b] - 1:p[b] + r[b] - 1]
        lp_ref.append(logp.gather(-1, ids[0, p[b]:p[b] + r[b], None])[:, 0])
        ent_ref.append(-(logp.exp() * logp).sum(-1))
    lp_ref, ent_ref = torch.cat(lp_ref), torch.cat(ent_ref)
    (coef * lp_ref).sum().backward()
    g_ref = {n: q.grad.detach().clone() for n, q in model.named_parameters()}
    images_ref = counter.images
    model.zero_grad(set_to_none=True)

    # zorro: one packed row, each unique image once
    counter.images = 0
    plan, media, _ = micro_batch_plan(
        td, {}, lambda mb, ids, am, rw: batch_media(ids, am, rw, _row_media(mb), media_tokens(model)),
        lambda mb, ids, am: rope_positions(model, ids, am, _row_media(mb)))
    lp, ent = zorro_gpt_step(model, plan, calculate_entropy=True, media=media)
    (coef * lp).sum().backward()
    g = {n: q.grad.detach().clone() for n, q in model.named_parameters()}
    rel = {n: ((g[n] - g_ref[n]).abs().max() / g_ref[n].abs().max().clamp_min(1e-300)).item() for n in g_ref}
    vision = [n for n in rel if n.startswith("visual.")]
    return {"log_probs": (lp - lp_ref).abs().max().item(), "entropy": (ent - ent_ref).abs().max().item(),
            "grad_rel": max(rel.values()), "grad_rel_worst": max(rel, key=rel.get),
            "vision_grad_rel": max(rel[n] for n in vision), "n_vision_params": len(vision), "n_params": len(rel),
            "vision_grad_max": max(g_ref[n].abs().max().item() for n in vision),
            "n_tokens": int(lp.numel()), "images_ref": images_ref, "images_zorro": counter.images,
            "dedup_ratio": plan.ordinary_tokens / plan.T, "dtype": str(lp.dtype)}


def run_rank(rank: int, world: int, init_file: str, ckpt: str) -> dict:
    import torch.distributed as dist

    from tests.support import megatron_engines as E
    from tests.support import megatron_vlm as V
    from tests.support.megatron_engine_ranks import ZORRO, _compare_engines
    from zorro_verl.integrations.megatron.attention import ZorroCoreAttention
    from zorro_verl.integrations.megatron.vlm import find_vlm_model

    E.setup_process()
    E.start_rank(rank, world, init_file, ckpt, save=V.save_tiny_qwen25vl)
    cfg = V.tiny_qwen25vl_config()
    batch = partial(V.make_vlm_batch, cfg, dynamic=False, micro_batch=MICRO_BATCH, max_tokens=MAX_TOKENS)
    build = partial(E.build_engine, ckpt, micro_batch=MICRO_BATCH, max_tokens=MAX_TOKENS)
    stock = build(zorro=None, remove_padding=False)
    zorro = build(zorro=ZORRO)
    vlm = find_vlm_model(zorro.module[0])
    lm = E.gpt_of(zorro).language_model
    out = {"model": {"class": type(E.gpt_of(stock)).__name__, "zorro_class": type(vlm).__name__,
                     "position_embedding": lm.position_embedding_type,
                     "zorro_attention": sum(isinstance(m, ZorroCoreAttention) for m in lm.modules()),
                     "vision_params": sum(1 for n, _ in E.gpt_of(zorro).named_parameters() if n.startswith("visual.")),
                     "engine": type(zorro).__name__}}
    # the bridge-built model through verl's stock engine vs transformers' own Qwen2.5-VL on the same checkpoint
    with stock.eval_mode():
        res = stock.infer_batch(batch(), loss_function=None)
    td = batch()
    lp = E.response_values(res["model_output"]["log_probs"], td)
    out["hf"] = {"log_probs": (lp - V.hf_vlm_log_probs(ckpt, td)).abs().max().item(), "n": int(lp.numel())}
    counters = {"stock": ImageCounter(E.gpt_of(stock)), "zorro": ImageCounter(vlm)}
    out["step1"] = _compare_engines(E, stock, zorro, batch, rank)
    out["images"] = {k: c.images for k, c in counters.items()}  # step 1: one infer_batch + one train_batch each
    out["step2"] = _step2(E, V, cfg, stock, zorro)
    # a prefix tree over tokens and images (prompts 0 and 1: the same tokens, different pixels, share only the text
    # before the image), dynamic token budget, fresh engines
    stock = build(zorro=None, remove_padding=False)
    zorro = build(zorro={**ZORRO, "sharing": "prefix", "min_shared_len": 1})
    out["prefix"] = _compare_engines(E, stock, zorro, partial(batch, dynamic=True), rank)
    out["fp64"] = _fp64_check(ckpt, cfg, V)
    dist.barrier()
    return out


if __name__ == "__main__":
    rank_main(run_rank, str)
