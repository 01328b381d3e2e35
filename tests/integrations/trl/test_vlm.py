"""TRL's image GRPO through zorro: ``GRPOTrainer._get_per_token_logps_and_entropies`` with ``pixel_values`` /
``image_grid_thw`` / ``num_images`` / ``mm_token_type_ids`` (TRL's layout: every row's image patches concatenated,
one grid row per image, per-row image counts) on a tiny Qwen2.5-VL built from a config (vision depth 2, 4-token
images, vocabulary 128).

The batch: 4 prompts x 3 completions, rows interleaved as after TRL's shuffle, left-padded prompts, right-padded
completions: A and B have the same text and different images of the same size (identical tokens: the grouping
trap), C has no image, D has two images (one of them A's); one completion is empty.

* fp64: zorro's method vs the ordinary forward (each row alone, its own images and the model's ``get_rope_index``
  positions, log-softmax of ``logits / T``): log-probs and entropies <= 1e-10 abs, every parameter's gradient (the
  vision tower's included) ``max|d|/max|ref| <= 1e-10``.
* fp32: zorro's method vs TRL's stock method (its fused head): log-probs / entropies <= 1e-5 abs, pads exactly 0,
  whole batch and TRL's row chunks; the vision tower encodes each unique prompt's images once.
* refusals: other families' keys, missing image counts, ``mm_token_type_ids`` that disagree with the placeholders.
* ``train()`` on an image dataset, stock vs zorro, 2 SGD steps, identical completions (full fine-tuning and LoRA):
  TRL's logged loss / grad norm / KL / entropy rel 1e-5, the weights after the steps 1e-6.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("trl")

from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

from tests.support.trl_assets import dataset, length_reward  # noqa: E402
from zorro_verl.integrations import trl as ztrl  # noqa: E402
from zorro_verl.integrations.transformers.vision import media_tokens, rope_positions, token_types  # noqa: E402
from zorro_verl.testing import grads_of, max_rel_grad_error  # noqa: E402
from zorro_verl.testing.vlm import VlmRow, image, prompt_with_media, tiny_vlm_model, vlm_batch  # noqa: E402

T = 0.9
KIND = "qwen2_5_vl"


def _trainer(cls, assets, tmp, **kw):
    """A GRPOTrainer (the tiny text assets: only its method, temperature and accelerator are used; the VLM is passed
    to the method as its ``model`` argument)."""
    out, tok = assets
    from transformers import AutoModelForCausalLM

    args = GRPOConfig(output_dir=str(tmp), per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
                      use_cpu=True, report_to="none", temperature=T, save_strategy="no", disable_tqdm=True,
                      beta=0.0, bf16=False)
    return cls(model=AutoModelForCausalLM.from_pretrained(out), reward_funcs=length_reward, args=args,
               train_dataset=dataset(4), processing_class=tok, **kw)


def _rows(dtype, seed=0, reps=3):
    a, b, c = image(1, dtype=dtype), image(2, dtype=dtype), image(3, 2, 3, dtype=dtype)
    prompts = [prompt_with_media([[1, 2], a, [3, 4]]),  # A
               prompt_with_media([[1, 2], b, [3, 4]]),  # B: same tokens as A, other pixels
               prompt_with_media([[5, 6, 7]]),  # C: text only
               prompt_with_media([[1], a, [8], c, [9]])]  # D: two images, one of them A's
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(reps):  # a prompt's completions scattered over the batch
        for p, media in prompts:
            n = int(torch.randint(1, 6, (1,), generator=g))
            rows.append(VlmRow(p, torch.randint(10, 100, (n,), generator=g).tolist(), media))
    rows[5].response = []
    return rows


def _trl_batch(model, rows):
    """TRL's seam arguments: ``(input_ids [B, S], attention_mask [B, S], logits_to_keep, media keywords)``."""
    batch = vlm_batch(rows)
    ids, am = batch["input_ids"], batch["attention_mask"]
    with_media = [r.media for r in rows if r.media]
    media = {"pixel_values": torch.cat([m["pixel_values"] for m in with_media]),
             "image_grid_thw": torch.cat([m["image_grid_thw"] for m in with_media]),
             "num_images": [0 if r.media is None else int(r.media["image_grid_thw"].shape[0]) for r in rows],
             "mm_token_type_ids": token_types(ids, media_tokens(model))}
    return ids, am, batch["responses"].shape[1], media


def _ordinary(model, rows):
    """Each row alone through the model's own forward: per row ``(log-probs [r], entropies [r])`` of ``logits / T``."""
    out = []
    for r in rows:
        ids = torch.tensor([r.prompt + r.response])
        media = r.media or {}
        pos = rope_positions(model, ids, None, [media])
        logits = model(input_ids=ids, position_ids=pos, use_cache=False, **media).logits[0]
        p, n = len(r.prompt), len(r.response)
        logp = torch.log_softmax(logits[p - 1:p + n - 1] / T, -1)
        out.append((logp.gather(-1, ids[0, p:p + n, None])[:, 0], -(logp.exp() * logp).sum(-1)))
    return out


def _encoded(model) -> list:
    """Images per vision tower call (a forward hook)."""
    seen: list = []
    model.model.visual.register_forward_hook(
        lambda m, args, kwargs, out: seen.append(int(kwargs.get("grid_thw", args[-1]).shape[0])), with_kwargs=True)
    return seen


@pytest.fixture(scope="module")
def trainers(trl_assets, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vlm")
    stock = _trainer(GRPOTrainer, trl_assets, tmp / "s")
    zorro = _trainer(ztrl.ZorroGRPOTrainer, trl_assets, tmp / "z", zorro={"attention_backend": "flash_copyfree"})
    zorro.model.train()  # the metrics go to "train"
    return stock, zorro


@pytest.mark.parametrize("sharing", ["prompt", "prefix"])
def test_fp64_method_equals_the_ordinary_forward(trainers, sharing):
    _, zorro = trainers
    zorro._zorro.settings = ztrl.trl_settings(attention_backend="flash_copyfree", sharing=sharing, min_shared_len=1)
    ref_model = tiny_vlm_model(KIND, dtype=torch.float64).train()
    model = copy.deepcopy(ref_model)
    rows = _rows(torch.float64)
    ids, am, C, media = _trl_batch(model, rows)
    g = torch.Generator().manual_seed(3)
    w = torch.randn(ids.shape[0], C, generator=g, dtype=torch.float64)
    ref = _ordinary(ref_model, rows)
    sum((lp * w[b, :len(lp)]).sum() + (ent * w[b, :len(ent)]).sum() for b, (lp, ent) in enumerate(ref)).backward()
    seen = _encoded(model)
    lp, ent, aux = zorro._get_per_token_logps_and_entropies(model, ids, am, C, compute_entropy=True, **media)
    m = am[:, -C:].bool()
    d_lp = max((lp[b, :len(r.response)] - ref[b][0]).abs().max().item() for b, r in enumerate(rows) if r.response)
    d_ent = max((ent[b, :len(r.response)] - ref[b][1]).abs().max().item() for b, r in enumerate(rows) if r.response)
    assert aux is None and lp.dtype == torch.float64 and bool((lp[~m] == 0).all() and (ent[~m] == 0).all())
    assert d_lp <= 1e-10 and d_ent <= 1e-10, (d_lp, d_ent)
    ((lp * w).sum() + (ent * w).sum()).backward()
    ref_grads = grads_of(ref_model)
    g_err, name = max_rel_grad_error(ref_grads, grads_of(model))
    assert g_err <= 1e-10, (name, g_err)
    assert any(n.startswith("model.visual") for n in ref_grads)
    # one vision tower call on the unique prompts' images: A's, B's, D's two (the ordinary batch holds 12)
    assert seen == [4] and zorro._metrics["train"]["zorro/media_dedup_ratio"][-1] == 12 / 4
    zorro._zorro.settings = ztrl.trl_settings(attention_backend="flash_copyfree")
    print(f"  fp64 {sharing}: log-prob {d_lp:.1e}, entropy {d_ent:.1e}, gradient {g_err:.1e} ({name})")


@pytest.mark.parametrize("batch_size", [None, 5])
def test_fp32_method_equals_stock(trainers, batch_size):
    stock, zorro = trainers
    base = tiny_vlm_model(KIND, dtype=torch.float32)
    stock_model, model = copy.deepcopy(base), copy.deepcopy(base)
    add_fused_lm_head(stock_model, temperature=T, outputs=("log_probs", "entropy"))  # as GRPOTrainer does
    rows = _rows(torch.float32, seed=1)
    ids, am, C, media = _trl_batch(model, rows)
    seen_stock, seen = _encoded(stock_model), _encoded(model)
    with torch.no_grad():
        lp_s, en_s, _ = stock._get_per_token_logps_and_entropies(stock_model, ids, am, C, batch_size, True, **media)
        lp_z, en_z, _ = zorro._get_per_token_logps_and_entropies(model, ids, am, C, batch_size, True, **media)
    m = am[:, -C:].bool()
    d_lp, d_en = (lp_s - lp_z).abs().max().item(), (en_s - en_z).abs().max().item()
    assert d_lp <= 1e-5 and d_en <= 1e-5, (d_lp, d_en)
    assert bool((lp_z[~m] == 0).all() and (en_z[~m] == 0).all())
    assert sum(seen) < sum(seen_stock) == 12  # stock encodes every row's images
    print(f"  fp32 batch_size={batch_size}: log-prob {d_lp:.1e}, entropy {d_en:.1e}; images encoded {sum(seen)} "
          f"(stock {sum(seen_stock)})")


def test_other_families_and_dropped_images_are_refused(trainers):
    _, zorro = trainers
    model = tiny_vlm_model(KIND, dtype=torch.float32)
    rows = _rows(torch.float32)[:4]
    ids, am, C, media = _trl_batch(model, rows)
    with pytest.raises(ValueError, match=r"multimodal inputs \(image_sizes\) of this model family"):
        zorro._get_per_token_logps_and_entropies(model, ids, am, C, **media, image_sizes=torch.ones(3, 2))
    no_counts = {k: v for k, v in media.items() if k != "num_images"}
    with pytest.raises(ValueError, match="pixel_values without image_grid_thw and num_images"):
        zorro._get_per_token_logps_and_entropies(model, ids, am, C, **no_counts)
    # TRL's truncated-tool-image path: the images dropped, mm_token_type_ids zeroed, placeholders kept
    zeroed = {"mm_token_type_ids": torch.zeros_like(media["mm_token_type_ids"])}
    with pytest.raises(ValueError, match="mm_token_type_ids disagree with the image / video placeholder"):
        zorro._get_per_token_logps_and_entropies(model, ids, am, C, **zeroed)


def _train(cls, out, proc, tmp, lora=False, **kw):
    """2 SGD steps of image GRPO (dapo, beta 0.04: a separate reference model, or with ``lora`` LoRA on the language
    model's q / v projections and the adapter disabled for the reference); returns (logs, weights, completions)."""
    from transformers import AutoModelForImageTextToText

    from tests.support.trl_assets import vlm_dataset

    args = GRPOConfig(output_dir=str(tmp), per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
                      use_cpu=True, report_to="none", beta=0.04, loss_type="dapo", max_steps=2, logging_steps=1,
                      seed=1, optim="sgd", learning_rate=0.5 if lora else 0.1, bf16=False, save_strategy="no",
                      temperature=T, disable_tqdm=True)
    if lora:
        from peft import LoraConfig

        kw["peft_config"] = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    tr = cls(model=AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32), reward_funcs=length_reward,
             args=args, train_dataset=vlm_dataset(2), processing_class=proc, **kw)
    completions, gen = [], tr._generate_and_score_completions

    def recorded(*a, **k):
        res = gen(*a, **k)
        assert res["pixel_values"].shape[0] == 8 * 16 and res["num_images"] == [1] * 8  # every row has its image
        completions.append(res["completion_ids"].clone())
        return res

    tr._generate_and_score_completions = recorded
    tr.train()
    logs = [h for h in tr.state.log_history if "loss" in h]
    return logs, {n: p.detach().clone() for n, p in tr.model.named_parameters()}, completions


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_train_matches_stock(tmp_path, lora):
    """``train()`` on an image dataset, stock vs zorro, identical completions: two prompts with the same text and
    different images in every step (a grouping on tokens alone would merge them). Loss, grad norm, KL, entropy per
    step rel 1e-5 (abs 1e-7), the weights after 2 steps (the vision tower's included) 1e-6."""
    from tests.support.trl_assets import build_vlm

    out, proc = build_vlm(tmp_path / "assets")
    ls, ws, cs = _train(GRPOTrainer, out, proc, tmp_path / "s", lora=lora)
    lz, wz, cz = _train(ztrl.ZorroGRPOTrainer, out, proc, tmp_path / "z", lora=lora,
                        zorro={"attention_backend": "sdpa"})
    assert len(cs) == len(cz) == 2 and all(torch.equal(a, b) for a, b in zip(cs, cz)), "completions differ"
    assert len(ls) == len(lz) == 2
    worst = {}
    for a, b in zip(ls, lz):
        for k in ("loss", "grad_norm", "kl", "entropy"):
            assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7), (k, a[k], b[k])
            worst[k] = max(worst.get(k, 0.0), abs(a[k] - b[k]))
        # 2 unique prompts (images) encoded per call instead of 8; prompt tokens deduplicated
        assert b["zorro/fallbacks"] == 0 and b["zorro/media_dedup_ratio"] == 4.0 and b["zorro/dedup_ratio"] > 1.5
    assert ws.keys() == wz.keys() and any("visual" in n for n in ws)
    moved = max((ws[n] - wz[n]).abs().max().item() for n in ws)
    assert moved <= 1e-6, moved
    print(f"  train {'lora' if lora else 'full'}: max |d| {worst}, weights {moved:.1e}, "
          f"dedup {[b['zorro/dedup_ratio'] for b in lz]}, "
          f"media {[b['zorro/media_dedup_ratio'] for b in lz]}")
