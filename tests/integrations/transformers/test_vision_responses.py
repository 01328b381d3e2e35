"""Images inside responses (a multi-turn agent whose tool returns an image), fp64: zorro's deduplicated step vs the
model's own forward of each row alone, on Qwen2.5-VL, Qwen3-VL dense and MoE and Qwen3.5 (tiny configs).

The batch (siblings interleaved): prompts A (an image), B (A's tokens, another image of the same size), T (text);
responses with no image, one tool image, two tool images of different sizes; two rows of A's group with different
response images, two with the same response start and the same tool image (in separate tensors), the same tool image
below B's and T's prompts. Oracle: each row alone (its prompt and response images, its 3-D positions from the model's
``get_rope_index``, sdpa, the vision tower per row).

Tolerances (fp64, as tests/integrations/transformers/test_vision.py): log-probs and entropy within ``1e-12``
absolute, gradients of every parameter (the vision tower's included) ``max|Δ|/max|ref| <= 1e-10`` per tensor.
"""

import copy

import pytest
import torch

from zorro_verl.integrations.transformers import install_zorro, zorro_step
from zorro_verl.integrations.transformers.vision import media_tokens, rope_positions
from zorro_verl.packing.multimodal import build_media_plan
from zorro_verl.testing import grads_of, max_rel_grad_error
from zorro_verl.testing.vlm import IMAGE, VLM_KINDS, agent_row, image, tiny_vlm_model, vlm_batch

LP_ABS_TOL = 1e-12
GRAD_REL_TOL = 1e-10
WORST: dict = {}


def _rows() -> list:
    a, b = image(1), image(2)
    x, y = image(21), image(22, 2, 3)
    x2 = (x[0].clone(), x[1].clone())
    A, B, T = [[1, 2], a, [3, 4]], [[1, 2], b, [3, 4]], [[5, 6, 7]]
    return [
        agent_row(A, [[30, 31]]),  # prompt image only
        agent_row(T, [[40], x, [41]]),  # response image only
        agent_row(A, [[32], x, [33, 34]]),  # both
        agent_row(B, [[32], x2, [33, 35]]),  # both, B's prompt
        agent_row(T, [[40], x2, [42], y, [43]]),  # two response images
        agent_row(A, [[32], y, [36]]),  # A's group, another response image
        agent_row(A, [[32], x2, [33, 37]]),  # A's group, row 2's response start and image
        agent_row(T, [[44, 45]]),  # text only
    ]


def _oracle(model, rows) -> tuple:
    """Per row alone: log-probs and entropy ``[r_b]`` of its response tokens."""
    lps, ents = [], []
    for r in rows:
        ids = torch.tensor([r.prompt + r.response])
        media = r.media or {}
        pos = rope_positions(model, ids, None, [media])
        logits = model(input_ids=ids, position_ids=pos, use_cache=False, **media).logits[0]
        p, n = len(r.prompt), len(r.response)
        lp = torch.log_softmax(logits[p - 1:p + n - 1], -1)
        lps.append(lp.gather(-1, ids[0, p:p + n, None])[:, 0])
        ents.append(-(lp.exp() * lp).sum(-1))
    return lps, ents


def _weights(rows, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(len(r.response), generator=g, dtype=torch.float64) for r in rows]


@pytest.mark.parametrize("sharing", ["prompt", "prefix"])
@pytest.mark.parametrize("kind", VLM_KINDS)
def test_response_images_match_each_rows_own_forward(kind, sharing):
    rows = _rows()
    w_lp, w_ent = _weights(rows, 1), _weights(rows, 2)
    ref_model = tiny_vlm_model(kind, seed=5)
    ref_model.zero_grad(set_to_none=True)
    ref_lp, ref_ent = _oracle(ref_model, rows)
    sum((lp * a).sum() + (e * c).sum() for lp, e, a, c in zip(ref_lp, ref_ent, w_lp, w_ent)).backward()
    ref_grads = grads_of(ref_model)

    model = copy.deepcopy(ref_model)
    install_zorro(model)
    encoded = []
    model.model.visual.register_forward_hook(
        lambda m, args, kwargs, out: encoded.append(int(kwargs.get("grid_thw", args[-1]).shape[0])), with_kwargs=True)
    batch = vlm_batch(rows)
    pos = rope_positions(model, batch["input_ids"], batch["attention_mask"], batch["media"])
    kw = {"min_shared_len": 1} if sharing == "prefix" else {}
    plan, media = build_media_plan(batch["input_ids"], batch["attention_mask"], batch["responses"].shape[1],
                                   batch["media"], media_tokens(model), pos, sharing=sharing, **kw)
    model.zero_grad(set_to_none=True)
    lp, ent = zorro_step(model, plan, media=media, calculate_entropy=True)
    errs = {}
    for name, got, ref in (("log-probs", plan.to_padded(lp.detach()), ref_lp),
                           ("entropy", plan.to_padded(ent.detach()), ref_ent)):
        errs[name] = max((got[b, :len(r.response)] - ref[b].detach()).abs().max().item()
                         for b, r in enumerate(rows) if r.response)
        assert errs[name] <= LP_ABS_TOL, f"{kind} {sharing}: {name} {errs[name]:.2e}"
    pad = lambda ws: plan.from_padded(torch.zeros(plan.B, plan.R, dtype=torch.float64).index_put_(  # noqa: E731
        (plan.out_row, plan.out_col), torch.cat(ws)))
    ((lp * pad(w_lp)).sum() + (ent * pad(w_ent)).sum()).backward()
    errs["gradients"], name = max_rel_grad_error(ref_grads, grads_of(model))
    assert errs["gradients"] <= GRAD_REL_TOL, f"{kind} {sharing}: gradient of {name} {errs['gradients']:.2e}"
    assert any(n.startswith("model.visual") for n in ref_grads)
    # response placeholders are predicted tokens too: the tool's image tokens carry log-probs
    assert int((plan.target_ids == IMAGE).sum()) == sum(r.response.count(IMAGE) for r in rows) > 0
    # the tower ran once: the unique prompts' images (A's, B's) and each response's own (7), or with the prefix tree
    # each tree node's (rows 2 / 6 and rows 1 / 4 share their response's image): 9 or 7 of the ordinary 12
    want = 9 if sharing == "prompt" else 7
    assert encoded == [want] and (media.items, media.row_items) == (want, 12)
    WORST[(kind, sharing)] = errs
