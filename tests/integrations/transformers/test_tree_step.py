"""The prefix-tree plan through the one model step vs the ordinary per-row forward on a tiny real Qwen3, fp64.

Random tries (hypothesis), a shared system prompt across different questions, verl's multi-output agent-loop samples
(output i > 0 carries the accumulated conversation as its prompt) and tool tokens masked out of the loss. Compared:
log-probs, entropy, the PPO loss over trained tokens and every parameter gradient. Tolerances (docs/design/testing.md):
log-prob / entropy / loss <= 1e-9 abs, gradients <= 1e-8 relative (measured ~1e-15 / ~1e-13).
"""

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings

from tests.integrations.transformers.test_step import WORST, _loss
from tests.packing.test_tree import tree_rows
from zorro_verl.integrations.transformers import install_zorro, zorro_step
from zorro_verl.packing import build_plan
from zorro_verl.testing import (
    batch_from_rows,
    grads_of,
    max_rel_grad_error,
    multi_turn_rows,
    ordinary_logprobs,
    shared_system_rows,
    tiny_model,
)

ABS_TOL = 1e-9
GRAD_REL_TOL = 1e-8
#: A parameter whose true gradient is 0 (a one-key softmax does not depend on its query: the q projection of a
#: 1-token row) has rounding noise on both sides; per-tensor relative errors are floored at this fraction of the
#: largest gradient so such noise is not divided by ~0.
GRAD_FLOOR = 1e-6
_MODELS = {}


def _scale(grads):
    return max(g.abs().max().item() for g in grads.values())


def _models():
    """One reference and one zorro model, built once (fresh gradients per comparison)."""
    if not _MODELS:
        ref, z = tiny_model("qwen3"), tiny_model("qwen3")
        install_zorro(z)
        ref.train()
        z.train()
        _MODELS.update(ref=ref, z=z)
    return _MODELS["ref"], _MODELS["z"]


def compare(batch, *, backend="sdpa", mode="none", min_shared_len=1, temperature=1.0, per_row=False):
    """``per_row``: zorro gets the temperature as a per-row tensor ``[B]`` (verl's per-sample temperatures)."""
    ref, z = _models()
    for m in (ref, z):
        m.zero_grad(set_to_none=True)
    R = batch["responses"].shape[1]
    lp_ref, ent_ref = ordinary_logprobs(ref, batch["input_ids"], batch["attention_mask"], R,
                                        temperature=temperature, calculate_entropy=True)
    loss_ref = _loss(lp_ref, ent_ref, batch)
    loss_ref.backward()
    plan = build_plan(batch["input_ids"], batch["attention_mask"], R, position_ids=batch["position_ids"],
                      sharing="prefix", min_shared_len=min_shared_len)
    t = torch.full((plan.B,), temperature, dtype=torch.float32) if per_row else temperature
    lp, ent = zorro_step(z, plan, backend=backend, temperature=t, calculate_entropy=True,
                         logits_optimization=mode, chunk_size=5)
    loss = _loss(lp, ent, batch)
    loss.backward()
    g_ref = grads_of(ref)
    errs = {"log-prob abs": (lp - lp_ref).abs().max().item() if lp.numel() else 0.0,
            "entropy abs": (ent - ent_ref).abs().max().item() if ent.numel() else 0.0,
            "loss abs": abs(loss.item() - loss_ref.item()),
            "grad rel": max_rel_grad_error(g_ref, grads_of(z), floor=GRAD_FLOOR * _scale(g_ref))[0]}
    for k, v in errs.items():
        WORST[k] = max(WORST[k], v)
    assert errs["log-prob abs"] <= ABS_TOL and errs["entropy abs"] <= ABS_TOL and errs["loss abs"] <= ABS_TOL, errs
    assert errs["grad rel"] <= GRAD_REL_TOL, errs
    return plan


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree_rows(vocab=100))
def test_random_tries_match_per_row(case):
    rows, masks, min_shared = case
    assume(any(1 in m for m in masks))  # the loss needs a trained token
    compare(batch_from_rows(rows, response_masks=masks, include_training_fields=True), min_shared_len=min_shared)


@pytest.mark.parametrize("backend", ["sdpa", "eager", "standard"])
@pytest.mark.parametrize("mode", ["none", "compute", "memory"])
def test_shared_system_prompt_across_questions(backend, mode):
    rows = shared_system_rows(3, 3, system_len=12, question_len=4, response_len=5, vocab_size=100, seed=1)
    rows[4] = (rows[4][0], rows[3][1][:2] + rows[4][1][2:])  # two responses of question 1 share 2 tokens
    plan = compare(batch_from_rows(rows, include_training_fields=True), backend=backend, mode=mode,
                   min_shared_len=2, temperature=0.7)
    assert plan.G == 1 and plan.tree.levels == 4  # system -> question -> shared response start -> rest
    assert plan.T < plan.ordinary_tokens


def test_multi_output_agent_loop_samples_with_masked_tool_tokens():
    rows, masks = multi_turn_rows(4, first_prompt_len=6, turn_len=3, observation_len=2, trajectories=2,
                                  vocab_size=100, seed=2)
    assert 0 in sum(masks, [])  # tool observations are context, not trained
    plan = compare(batch_from_rows(rows, response_masks=masks, include_training_fields=True), min_shared_len=1)
    # each trajectory's last sample holds the whole conversation: the tree computes it once
    longest = max(len(p) + len(r) for p, r in rows[:4]) + max(len(p) + len(r) for p, r in rows[4:])
    assert plan.T == longest and plan.G == 2
    # every response token is computed once: the head runs once per distinct predicting position
    assert plan.head_index.numel() == plan.N


def test_tree_rollout_with_shared_turns():
    from tests.attention.test_tree_backends import branching_rows

    rows = branching_rows(depth=3, width=2, turn=3, seed=4)
    plan = compare(batch_from_rows(rows, include_training_fields=True), min_shared_len=1, mode="compute")
    assert plan.tree.levels == 4


@pytest.mark.parametrize("min_shared", [1, 4, 100])
def test_min_shared_len_and_identical_rows(min_shared):
    rows = shared_system_rows(2, 3, system_len=6, question_len=2, response_len=4, vocab_size=100, seed=3)
    rows.append(rows[0])  # an identical row: same tokens, same outputs
    rows.append((rows[1][0], rows[1][1][:2]))  # a row that is a prefix of another
    plan = compare(batch_from_rows(rows, include_training_fields=True), min_shared_len=min_shared)
    if min_shared == 100:  # nothing long enough to share beyond identical prompts (the prompt plan's sharing) and
        # identical rows (the duplicate's response once); the 2-token shared response start is recomputed
        assert plan.T == build_plan(*_plan_args(rows)).T - len(rows[0][1])


def _plan_args(rows):
    b = batch_from_rows(rows)
    return b["input_ids"], b["attention_mask"], b["responses"].shape[1]


@pytest.mark.parametrize("per_row", [False, True])
def test_memory_mode_runs_the_head_once_per_distinct_position(per_row, monkeypatch):
    """The memory mode on a tree whose rows share response tokens: exact, the head module called once (so FSDP2
    gathers it once), and its ``F.linear`` on the ``Nh`` distinct predicting positions — once in forward, once in the
    backward's recompute — not on the ``N`` outputs. A per-row temperature tensor with one value runs the same."""
    rows = shared_system_rows(2, 3, system_len=8, question_len=3, response_len=6, vocab_size=100, seed=5)
    rows[1] = (rows[1][0], rows[0][1][:4] + rows[1][1][4:])  # responses of one question share 4 and 2 tokens
    rows[2] = (rows[2][0], rows[0][1][:2] + rows[2][1][2:])
    _, z = _models()
    weight, rows_seen, calls = z.lm_head.weight, [], []
    linear = torch.nn.functional.linear

    def counting(x, w, b=None):
        if w.data_ptr() == weight.data_ptr():  # the head (backward's saved weight is another tensor object)
            rows_seen.append(x.shape[0])
        return linear(x, w, b)

    monkeypatch.setattr(torch.nn.functional, "linear", counting)
    hook = z.lm_head.register_forward_pre_hook(lambda m, a: calls.append(1))
    try:
        plan = compare(batch_from_rows(rows, include_training_fields=True), mode="memory", min_shared_len=2,
                       temperature=0.5, per_row=per_row)  # 0.5: exact in the per-row tensor's fp32
    finally:
        hook.remove()
    nh = plan.head_index.numel()
    assert nh <= plan.N - 2 * 2 - 4 - 2  # per question its last prompt token (3 rows), the 4 + 2 shared response tokens
    assert calls == [1] and sum(rows_seen) == 2 * nh and max(rows_seen) <= 5  # chunk_size=5 in compare
