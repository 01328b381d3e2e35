"""Vision-language models (Qwen2.5-VL, Qwen3-VL dense and MoE, Qwen3.5 multimodal): zorro's deduplicated step vs
the ordinary per-row forward, fp64, tiny configs (vision depth 2, 4-token images), random images.

The batch holds GRPO groups whose rows are interleaved: two prompts with the same text and *different images of the
same size* (identical placeholder tokens: the grouping trap), a text-only prompt, a prompt with two images (one of
them shared with another prompt), responses of 0-4 tokens. Oracle: each row alone through the model's own forward
(its pixels, its 3-D positions from the model's ``get_rope_index``, sdpa attention, the vision tower per row).

Tolerances (fp64): log-probs within ``1e-12`` absolute (measured ~1e-15); gradients of every parameter, the vision
tower's included, ``max|Δ|/max|ref| <= 1e-10`` per tensor (measured <= ~1e-13; the delta rule of Qwen3.5's linear
layers sums decay terms with cancellation: see test_hybrid.py, which bounds those two parameters by the oracle's
own chunking error — here the same bound, measured below it).
"""

import copy

import pytest
import torch

from zorro_verl.api import DeduplicatedActor
from zorro_verl.integrations.transformers import install_zorro, uninstall_zorro, zorro_step
from zorro_verl.integrations.transformers.vision import media_tokens, rope_positions
from zorro_verl.packing import build_plan
from zorro_verl.packing.multimodal import batch_media, build_media_plan, keyed_id, pack_media
from zorro_verl.testing import grads_of, max_rel_grad_error
from zorro_verl.testing.vlm import (
    IMAGE,
    MERGE,
    PATCH_DIM,
    V_END,
    V_START,
    VIDEO,
    VLM_KINDS,
    VlmRow,
    image,
    ordinary_vlm_logprobs,
    prompt_with_media,
    tiny_vlm_model,
    vlm_batch,
)

LP_ABS_TOL = 1e-12
GRAD_REL_TOL = 1e-10
WORST: dict = {}


def _rows(seed: int = 0, reps: int = 3) -> list:
    a, b, c = image(1), image(2), image(3, 2, 3)
    prompts = [prompt_with_media([[1, 2], a, [3, 4]]),  # A
               prompt_with_media([[1, 2], b, [3, 4]]),  # B: same text, a different image of the same size
               prompt_with_media([[5, 6, 7]]),  # C: no image
               prompt_with_media([[1], a, [8], c, [9]])]  # D: two images, one of them A's
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(reps):  # siblings interleaved: A B C D A B C D ...
        for p, media in prompts:
            n = int(torch.randint(0, 5, (1,), generator=g))
            rows.append(VlmRow(p, torch.randint(10, 100, (n,), generator=g).tolist(), media))
    rows[2].response = []  # an empty response
    rows[-3].response = [42]  # a 1-token response
    return rows


def _weights(rows, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(len(r.response), generator=g, dtype=torch.float64) for r in rows]


def _plan(model, rows, sharing):
    batch = vlm_batch(rows)
    pos = rope_positions(model, batch["input_ids"], batch["attention_mask"], batch["media"])
    kw = {"min_shared_len": 1} if sharing == "prefix" else {}
    return build_media_plan(batch["input_ids"], batch["attention_mask"], batch["responses"].shape[1],
                            batch["media"], media_tokens(model), pos, sharing=sharing, **kw)


def _ordinary(model, rows, weights):
    model.zero_grad(set_to_none=True)
    ref = ordinary_vlm_logprobs(model, rows)
    sum((lp * w).sum() for lp, w in zip(ref, weights)).backward()
    return [x.detach() for x in ref], grads_of(model)


@pytest.mark.parametrize("sharing", ["prompt", "prefix"])
@pytest.mark.parametrize("kind", VLM_KINDS)
def test_matches_ordinary_forward(kind, sharing):
    rows = _rows()
    weights = _weights(rows)
    ref_model = tiny_vlm_model(kind)
    ref, ref_grads = _ordinary(ref_model, rows, weights)
    model = copy.deepcopy(ref_model)
    install_zorro(model)
    encoded = []
    model.model.visual.register_forward_hook(
        lambda m, args, kwargs, out: encoded.append(int(kwargs.get("grid_thw", args[-1]).shape[0])), with_kwargs=True)
    plan, media = _plan(model, rows, sharing)
    model.zero_grad(set_to_none=True)
    lp, _ = zorro_step(model, plan, media=media)
    got = plan.to_padded(lp)
    lp_err = max((got[b, :len(r.response)] - ref[b]).abs().max().item() for b, r in enumerate(rows) if r.response)
    assert lp_err <= LP_ABS_TOL, f"{kind} {sharing}: log-probs {lp_err:.2e}"
    w = torch.zeros(plan.B, plan.R, dtype=torch.float64).index_put_((plan.out_row, plan.out_col), torch.cat(weights))
    (lp * plan.from_padded(w)).sum().backward()
    g_err, name = max_rel_grad_error(ref_grads, grads_of(model))
    assert g_err <= GRAD_REL_TOL, f"{kind} {sharing}: gradient of {name} {g_err:.2e}"
    assert any(n.startswith("model.visual") for n in ref_grads)  # the vision tower is trained and compared
    # the vision tower ran once, on the unique prompts' images: A's, B's, and D's two (A and D differ in text before
    # the image, so even the prefix tree cannot share it); the ordinary batch encodes 3 x 4 = 12
    assert encoded == [4] and media.items == 4 and media.row_items == 12
    WORST[(kind, sharing)] = {"log-probs": lp_err, "gradients": g_err}


def test_grouping_trap_same_size_different_images():
    """Rows A and B have identical tokens (same text, same-size images) but different pixels: token grouping alone
    would share them; the keyed ids keep them apart, and equal pixels in distinct tensors still share."""
    model = tiny_vlm_model("qwen2_5_vl")
    rows = _rows()
    batch = vlm_batch(rows)
    R = batch["responses"].shape[1]
    tokens_only = build_plan(batch["input_ids"], batch["attention_mask"], R)
    assert tokens_only.G == 3  # A and B merged: what zorro must not do
    plan, _ = _plan(model, rows, "prompt")
    assert plan.G == 4
    assert plan.row_group[0] != plan.row_group[1] and plan.row_group[0] == plan.row_group[4]
    # equal content in separate tensors (another copy of image a) shares; keys are content, not identity
    a2 = (image(1)[0].clone(), image(1)[1].clone())
    p, m = prompt_with_media([[1, 2], a2, [3, 4]])
    rows2 = rows[:4] + [VlmRow(p, [11, 12], m)]
    plan2, media2 = _plan(model, rows2, "prompt")
    assert plan2.G == 4 and plan2.row_group[4] == plan2.row_group[0] and media2.items == 4
    bm = batch_media(batch["input_ids"], batch["attention_mask"], R, batch["media"], media_tokens(model))
    keys = {it.key for row in bm.items for it in row}
    assert len(keys) == 3 and all(keyed_id(k) >= 2 ** 62 for k in keys)


def test_frozen_vision_tower_gets_no_gradient():
    rows = _rows(reps=2)
    weights = _weights(rows)
    ref_model = tiny_vlm_model("qwen2_5_vl")
    ref_model.model.visual.requires_grad_(False)
    ref, ref_grads = _ordinary(ref_model, rows, weights)
    model = copy.deepcopy(ref_model)
    install_zorro(model)
    plan, media = _plan(model, rows, "prompt")
    lp, _ = zorro_step(model, plan, media=media)
    w = torch.zeros(plan.B, plan.R, dtype=torch.float64).index_put_((plan.out_row, plan.out_col), torch.cat(weights))
    (lp * plan.from_padded(w)).sum().backward()
    got = grads_of(model)
    assert not any(n.startswith("model.visual") for n in got)
    assert max_rel_grad_error(ref_grads, got)[0] <= GRAD_REL_TOL


def test_uninstall_restores_the_language_models_attention():
    """install_zorro switches the language model (text_config) as well as the root; uninstall_zorro must switch
    both back (it restored the root only: the next ordinary forward reached zorro's attention without a plan)."""
    rows = _rows(reps=1)
    model = tiny_vlm_model("qwen2_5_vl")
    ref = ordinary_vlm_logprobs(model, rows)
    install_zorro(model)
    assert model.config.text_config._attn_implementation != "sdpa"
    uninstall_zorro(model)
    cfg = model.config
    assert (cfg._attn_implementation, cfg.text_config._attn_implementation,
            cfg.vision_config._attn_implementation) == ("sdpa", "sdpa", "sdpa")
    got = ordinary_vlm_logprobs(model, rows)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl"])
def test_video_and_multi_image_rows(kind):
    """A video (2 temporal patches) and an image in one prompt, siblings interleaved. Qwen2.5-VL: the video's
    placeholders in one run; Qwen3-VL: one run per frame with text between (its processor puts a timestamp there):
    an item's placeholders need not be contiguous, only in order."""
    model = tiny_vlm_model(kind, seed=3)
    g = torch.Generator().manual_seed(5)
    vgrid = torch.tensor([[2, 2 * MERGE, 2 * MERGE]])
    video = torch.randn(int(vgrid.prod()), PATCH_DIM, generator=g, dtype=torch.float64)
    img, igrid = image(7)
    per_frame = int(vgrid[0, 1:].prod()) // MERGE ** 2
    frames = [VIDEO] * (2 * per_frame) if kind == "qwen2_5_vl" else [VIDEO] * per_frame + [50, 51] + [VIDEO] * per_frame
    toks = [1, V_START] + frames + [V_END, 2, V_START] + [IMAGE] * (int(igrid.prod()) // MERGE ** 2) + [V_END, 3]
    media = {"pixel_values_videos": video, "video_grid_thw": vgrid, "pixel_values": img, "image_grid_thw": igrid,
             "second_per_grid_ts": torch.tensor([1.0])}
    other, om = prompt_with_media([[4, 5], image(8), [6]])
    rows = [VlmRow(toks, [20, 21, 22], media), VlmRow(other, [30], om), VlmRow(toks, [23], media),
            VlmRow(other, [31, 32], om)]
    ordinary_media = [{k: v for k, v in (r.media or {}).items() if k != "second_per_grid_ts"} for r in rows]
    ref = ordinary_vlm_logprobs(model, [VlmRow(r.prompt, r.response, m) for r, m in zip(rows, ordinary_media)])
    install_zorro(model)
    plan, packed = _plan(model, rows, "prompt")
    assert packed.items == 3 and packed.inputs["video_grid_thw"].tolist() == vgrid.tolist()
    got = plan.to_padded(zorro_step(model, plan, media=packed)[0].detach())
    err = max((got[b, :len(r.response)] - ref[b]).abs().max().item() for b, r in enumerate(rows))
    assert err <= LP_ABS_TOL


def test_bad_inputs_raise_naming_the_field():
    model = tiny_vlm_model("qwen2_5_vl")
    tokens = media_tokens(model)
    rows = _rows(reps=1)
    batch = vlm_batch(rows)
    R = batch["responses"].shape[1]
    ids, am = batch["input_ids"], batch["attention_mask"]
    # placeholders without pixels
    media = list(batch["media"])
    media[0] = None
    with pytest.raises(ValueError, match=r"media\[0\]: the row has 4 image placeholder tokens \(id 120\) but no "
                                         r"pixel_values"):
        batch_media(ids, am, R, media, tokens)
    # a grid that does not match the placeholders
    media = list(batch["media"])
    media[0] = {"pixel_values": media[0]["pixel_values"], "image_grid_thw": torch.tensor([[1, 2, 2]])}
    with pytest.raises(ValueError, match=r"media\[0\]: 4 image placeholder tokens and 16 patch rows"):
        batch_media(ids, am, R, media, tokens)
    # an input zorro does not know
    media = list(batch["media"])
    media[0] = {**media[0], "image_bound": torch.zeros(1)}
    with pytest.raises(ValueError, match=r"media\[0\]: multimodal inputs \['image_bound'\] are not supported"):
        batch_media(ids, am, R, media, tokens)
    # positions that disagree inside a group (rows 0 and 4 share A's prompt)
    rows = _rows(reps=2)
    batch = vlm_batch(rows)
    pos = rope_positions(model, batch["input_ids"], batch["attention_mask"], batch["media"])
    pos[:, 4] += 1
    with pytest.raises(ValueError, match="position_ids: rows that share a prompt have different 3-D positions"):
        build_media_plan(batch["input_ids"], batch["attention_mask"], batch["responses"].shape[1], batch["media"],
                         tokens, pos)
    # a plan not built from the keyed ids: A's and B's images under one prompt
    bm = batch_media(batch["input_ids"], batch["attention_mask"], batch["responses"].shape[1], batch["media"], tokens)
    wrong = build_plan(batch["input_ids"], batch["attention_mask"], batch["responses"].shape[1])
    with pytest.raises(ValueError, match="position_ids|pack_media"):
        pack_media(wrong, bm, rope_positions(model, batch["input_ids"], batch["attention_mask"], batch["media"]))


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_5"])
def test_prefix_tree_shares_an_image_in_the_system_prompt(kind):
    """An image in a shared system prompt, then different questions (one of them with an image of its own): with
    sharing='prefix' the system image is encoded once for every group; log-probs and gradients equal the oracle."""
    sys_img, q_img = image(11, 2, 3), image(12)
    questions = [[[40, 41]], [[42], q_img, [43]], [[44, 45, 46]]]
    rows = []
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        for q in questions:
            p, m = prompt_with_media([[1, 2, 3], sys_img, [4]] + q)
            rows.append(VlmRow(p, torch.randint(10, 100, (int(torch.randint(1, 4, (1,), generator=g)),),
                                                generator=g).tolist(), m))
    weights = _weights(rows)
    ref_model = tiny_vlm_model(kind, seed=4)
    ref, ref_grads = _ordinary(ref_model, rows, weights)
    model = copy.deepcopy(ref_model)
    install_zorro(model)
    plan, media = _plan(model, rows, "prefix")
    assert plan.G == 1 and media.items == 2 and media.row_items == 8  # the system image once, the question's once
    lp, _ = zorro_step(model, plan, media=media)
    got = plan.to_padded(lp.detach())
    assert max((got[b, :len(r.response)] - ref[b]).abs().max().item() for b, r in enumerate(rows)) <= LP_ABS_TOL
    w = torch.zeros(plan.B, plan.R, dtype=torch.float64).index_put_((plan.out_row, plan.out_col), torch.cat(weights))
    (lp * plan.from_padded(w)).sum().backward()
    assert max_rel_grad_error(ref_grads, grads_of(model))[0] <= GRAD_REL_TOL


def _video_row(seed: int, frames: int, ts) -> tuple:
    """A Qwen2.5-VL prompt with a video of ``frames`` temporal patches (2x2 merged tokens each, one run of
    placeholders) and ``second_per_grid_ts = ts`` (None: absent)."""
    g = torch.Generator().manual_seed(seed)
    vgrid = torch.tensor([[frames, 2 * MERGE, 2 * MERGE]])
    media = {"pixel_values_videos": torch.randn(int(vgrid.prod()), PATCH_DIM, generator=g, dtype=torch.float64),
             "video_grid_thw": vgrid}
    if ts is not None:
        media["second_per_grid_ts"] = torch.tensor([ts], dtype=torch.float64)
    toks = [1, V_START] + [VIDEO] * (int(vgrid.prod()) // MERGE ** 2) + [V_END, 2, 3]
    return toks, media


def _own_forward_logprobs(model, rows) -> list:
    """Each row alone through the model's own forward with *no* positions given: the model computes its 3-D
    positions itself from ``mm_token_type_ids`` and the row's media (``second_per_grid_ts`` included)."""
    out = []
    for r in rows:
        ids = torch.tensor([r.prompt + r.response])
        types = (ids == IMAGE).int() + 2 * (ids == VIDEO).int()
        logits = model(input_ids=ids, mm_token_type_ids=types, use_cache=False, **(r.media or {})).logits[0]
        p, n = len(r.prompt), len(r.response)
        out.append(torch.log_softmax(logits[p - 1:p + n - 1], -1).gather(-1, ids[0, p:p + n, None])[:, 0])
    return out


def test_second_per_grid_ts_feeds_qwen2_5_vl_positions():
    """Qwen2.5-VL spaces a video's temporal positions by ``tokens_per_second * int(second_per_grid_ts)``:
    rope_positions must pass each row's values (it ignored them: every video got the 1 s default, silently other
    positions than the model's own forward). Rows: a 3-frame video at 2.0 s (twice), another at 0.5 s (int: 0), an
    image row, a video without the field (default 1)."""
    model = tiny_vlm_model("qwen2_5_vl", seed=6)
    v2, m2 = _video_row(21, 3, 2.0)
    v05, m05 = _video_row(22, 2, 0.5)
    v1, m1 = _video_row(23, 2, None)
    img, mi = prompt_with_media([[4, 5], image(24), [6]])
    rows = [VlmRow(v2, [20, 21, 22], m2), VlmRow(v05, [30, 31], m05), VlmRow(img, [40], mi),
            VlmRow(v2, [23], m2), VlmRow(v1, [50, 51], m1)]
    batch = vlm_batch(rows)
    ids, am = batch["input_ids"], batch["attention_mask"]
    pos = rope_positions(model, ids, am, batch["media"])
    types = (ids == IMAGE).int() + 2 * (ids == VIDEO).int()
    own, _ = model.model.get_rope_index(ids, types, image_grid_thw=mi["image_grid_thw"],
                                        video_grid_thw=torch.cat([m2["video_grid_thw"], m05["video_grid_thw"],
                                                                  m2["video_grid_thw"], m1["video_grid_thw"]]),
                                        second_per_grid_ts=torch.tensor([2.0, 0.5, 2.0, 1.0]), attention_mask=am)
    assert pos.dtype == torch.int64 and torch.equal(pos, own.long())
    # the field is seen: without it rows 0, 1 and 3 get other temporal positions (rows 2 and 4 the same)
    plain = [{k: v for k, v in (m or {}).items() if k != "second_per_grid_ts"} for m in batch["media"]]
    at_1s = rope_positions(model, ids, am, plain)
    differs = [not torch.equal(pos[:, b], at_1s[:, b]) for b in range(len(rows))]
    assert differs == [True, True, False, True, False]
    # the standalone path (rope_positions + build_media_plan + zorro_step) equals each row's own forward, whose
    # log-probs the field changes
    ref = _own_forward_logprobs(model, rows)
    ref_1s = _own_forward_logprobs(model, [VlmRow(r.prompt, r.response, m) for r, m in zip(rows, plain)])
    assert (ref[0] - ref_1s[0]).abs().max().item() > 1e-6
    install_zorro(model)
    plan, packed = _plan(model, rows, "prompt")
    got = plan.to_padded(zorro_step(model, plan, media=packed)[0].detach())
    err = max((got[b, :len(r.response)] - ref[b]).abs().max().item() for b, r in enumerate(rows))
    assert err <= LP_ABS_TOL, f"log-probs {err:.2e}"
    bad = list(batch["media"])
    bad[0] = {**bad[0], "second_per_grid_ts": torch.tensor([2.0, 2.0])}
    with pytest.raises(ValueError, match=r"media\[0\].second_per_grid_ts: expected one value per video of the row "
                                         r"\(1, as video_grid_thw's rows\), got 2"):
        rope_positions(model, ids, am, bad)


def test_placeholders_and_media_must_match_per_row():
    """A row with placeholders but no media ran as text (the model scatters no features; get_rope_index failed with
    a bare TypeError), a row with media but no placeholders shifted the later rows' grids: both raise, naming the
    row, the placeholder token and count and what is missing."""
    model = tiny_vlm_model("qwen2_5_vl")
    batch = vlm_batch(_rows(reps=1))  # rows A B C D: C has no image
    ids, am = batch["input_ids"], batch["attention_mask"]
    media = list(batch["media"])
    media[1] = None
    with pytest.raises(ValueError, match=r"media\[1\]: row 1 has 4 image placeholder tokens \(id 120\) but no "
                                         r"image_grid_thw/pixel_values: pass the row's media or remove the "
                                         r"placeholders"):
        rope_positions(model, ids, am, media)
    media = list(batch["media"])
    media[2] = batch["media"][0]
    with pytest.raises(ValueError, match=r"media\[2\]: row 2 has 0 image placeholder tokens \(id 120\) but "
                                         r"image_grid_thw \[\[1, 4, 4\]\] gives 4"):
        rope_positions(model, ids, am, media)
    media = list(batch["media"])
    media[0] = {"image_grid_thw": media[0]["image_grid_thw"]}
    with pytest.raises(ValueError, match=r"media\[0\]: row 0 has image_grid_thw but no pixel_values"):
        rope_positions(model, ids, am, media)


def test_standalone_actor_refuses_media_it_cannot_take():
    """DeduplicatedActor runs text batches: on a vision-language model a row with placeholder tokens ran as plain
    text (no features, 1-D positions) without a word; multimodal keys in the batch were dropped. Both raise; a text
    batch on the same model still equals the ordinary forward."""
    model = tiny_vlm_model("qwen2_5_vl")
    rows = _rows(reps=1)
    batch = vlm_batch(rows)
    mb = {k: batch[k] for k in ("input_ids", "attention_mask", "responses")}
    text = [VlmRow([5, 6, 7], [11, 12]), VlmRow([5, 6, 7], [13]), VlmRow([8, 9], [14, 15, 16])]
    ref = ordinary_vlm_logprobs(model, text)  # before the actor installs zorro
    actor = DeduplicatedActor.from_model(model)
    with pytest.raises(ValueError, match=r"micro_batch\['input_ids'\]: row 0 has 4 image placeholder tokens "
                                         r"\(id 120\) but no image_grid_thw/pixel_values: DeduplicatedActor takes no "
                                         r"media"):
        actor.forward(mb)
    with pytest.raises(ValueError, match=r"micro_batch: multimodal inputs \['pixel_values', 'image_grid_thw'\] are "
                                         r"not taken by DeduplicatedActor"):
        actor.forward({**mb, "pixel_values": rows[0].media["pixel_values"],
                       "image_grid_thw": rows[0].media["image_grid_thw"]})
    tb = vlm_batch(text)
    got = actor.forward({k: tb[k] for k in ("input_ids", "attention_mask", "responses")}).logprobs.detach()
    assert (got - torch.cat(ref)).abs().max().item() <= LP_ABS_TOL


def test_sequence_parallel_slice_of_the_language_models_inputs():
    """``vision._slice_text_inputs`` (the SP hook's cut, run end to end in test_ulysses_step.py): the rank's slice of
    the embeddings and 3-D positions, and of Qwen3-VL's deepstack features exactly the visual positions it holds;
    a call on anything but the whole padded row, or a model without a language model beside its tower, raises."""
    from types import SimpleNamespace

    from zorro_verl.integrations.transformers.vision import _slice_text_inputs, sliced_language_model
    from zorro_verl.testing import tiny_model

    T_pad, H = 8, 3
    emb = torch.arange(T_pad * H, dtype=torch.float64).view(1, T_pad, H)
    pos = torch.arange(3 * T_pad).view(3, 1, T_pad)
    mask = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 0]], dtype=torch.bool)  # 5 visual positions, 2 before the cut at 3
    deep = [torch.arange(5 * H, dtype=torch.float64).view(5, H) + 100 * k for k in range(2)]
    got = _slice_text_inputs({"inputs_embeds": emb, "position_ids": pos, "visual_pos_masks": mask,
                              "deepstack_visual_embeds": deep, "other": 1}, 3, 6, T_pad)
    assert torch.equal(got["inputs_embeds"], emb[:, 3:6]) and torch.equal(got["position_ids"], pos[..., 3:6])
    assert torch.equal(got["visual_pos_masks"], mask[:, 3:6]) and got["other"] == 1
    assert [d.tolist() for d in got["deepstack_visual_embeds"]] == [d[2:4].tolist() for d in deep]  # rows 3 and 5
    with pytest.raises(ValueError, match=r"expected the whole padded row \[1, 9, H\]"):
        _slice_text_inputs({"inputs_embeds": emb}, 0, 4, 9)
    shard = SimpleNamespace(start=0, local_len=4, padded_len=8)
    with pytest.raises(ValueError, match="no `language_model` beside its vision tower"):
        with sliced_language_model(tiny_model("qwen3", dtype=torch.float64, seed=0), shard):
            pass
