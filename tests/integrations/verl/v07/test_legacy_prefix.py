"""ZoRRoDataParallelPPOActor with ``sharing=prefix`` (prefix trees) vs verl 0.7.1's stock DataParallelPPOActor on CPU
(fp32, one gloo process), on an agentic batch: a system prompt shared by different questions (several samples
each) plus multi-turn trajectories emitted as one sample per turn (each sample's prompt holds the earlier turns,
tool observations masked out of the loss), clusters interleaved. Tolerances as the legacy-actor suite: log-probs /
entropy max abs <= 1e-5 on valid response tokens; losses, grad norms and updated weights <= 1e-5 (relative)."""

from __future__ import annotations

import pytest
import torch

from tests.integrations.verl.v07.conftest import ZORRO_ON, make_actor, make_actor_config, to_data_proto
from tests.integrations.verl.v07.test_legacy_actor import _assert_logprobs_equal, _assert_updates_equal, _classes

PREFIX_ON = {**ZORRO_ON, "sharing": "prefix", "min_shared_len": 4}
#: clusters interleaved: rows 0..8 share one system prompt (3 questions x 3 samples), 9..14 two 3-turn trajectories
ORDER = [4, 9, 0, 12, 2, 7, 13, 5, 1, 10, 3, 14, 6, 11, 8]
B = len(ORDER)


def _agentic_tensors(order=ORDER) -> dict:
    from zorro_verl.testing import batch_from_rows, multi_turn_rows, shared_system_rows

    rows = shared_system_rows(3, 3, system_len=10, question_len=3, response_len=4, vocab_size=128, seed=7)
    turns, masks = multi_turn_rows(3, first_prompt_len=5, turn_len=3, observation_len=2, trajectories=2,
                                   vocab_size=128, seed=8)
    rows, masks = rows + turns, [[1] * len(r) for _, r in rows] + masks
    return batch_from_rows([rows[i] for i in order], response_masks=[masks[i] for i in order],
                           include_training_fields=True, seed=9)


def _pair(base_model, **cfg):
    Stock, Zorro = _classes()
    stock = make_actor(Stock, base_model, make_actor_config(**cfg))
    zorro = make_actor(Zorro, base_model, make_actor_config(zorro=PREFIX_ON, **cfg))
    stock._initial = [p.detach().clone() for p in stock.actor_module.parameters()]
    assert zorro.zorro_active
    return stock, zorro


@pytest.fixture
def plans(monkeypatch):
    """Every plan the zorro actor builds: ``(T, ordinary tokens, rows, tree levels)``."""
    import zorro_verl.integrations.verl.v07.actor as legacy

    seen, build = [], legacy.build_plan

    def recording(*args, **kwargs):
        plan = build(*args, **kwargs)
        seen.append((plan.T, plan.ordinary_tokens, plan.B, plan.tree.levels if plan.tree is not None else 0))
        return plan

    monkeypatch.setattr(legacy, "build_plan", recording)
    return seen


@pytest.mark.parametrize("use_dynamic_bsz", [False, True], ids=["fixed", "dynamic"])
def test_compute_log_prob_matches_stock(base_model, plans, use_dynamic_bsz):
    stock, zorro = _pair(base_model, use_dynamic_bsz=use_dynamic_bsz)
    data = to_data_proto(_agentic_tensors(), use_dynamic_bsz=use_dynamic_bsz, micro=5, max_token_len=60)
    mask = data.batch["response_mask"].bool()
    ref = stock.compute_log_prob(data, calculate_entropy=True)
    got = zorro.compute_log_prob(data, calculate_entropy=True)
    assert mask.sum() > 40 and ref["log_probs"][mask].abs().max() > 1.0
    _assert_logprobs_equal(ref, got, mask)
    m = zorro.zorro_metrics()
    # every micro-batch ran a tree plan, clusters whole; the system prompt's cluster is a 3-level tree
    assert plans and all(levels >= 1 for *_, levels in plans) and sum(b for _, _, b, _ in plans) == B
    assert m["zorro/tree_depth"] == 3.0 and m["zorro/fallback_batches"] == 0
    ordinary, computed = sum(o for _, o, _, _ in plans), sum(t for t, _, _, _ in plans)
    assert m["zorro/dedup_ratio"] == pytest.approx(ordinary / computed, rel=1e-12) and m["zorro/dedup_ratio"] > 1.8
    ref = stock.compute_log_prob(data, calculate_entropy=False)
    got = zorro.compute_log_prob(data, calculate_entropy=False)
    _assert_logprobs_equal(ref, got, mask, entropy=False)


@pytest.mark.parametrize("use_dynamic_bsz", [False, True], ids=["fixed", "dynamic"])
def test_update_policy_matches_stock(base_model, use_dynamic_bsz):
    """seq-mean-token-mean (verl 0.7 normalises per micro-batch; this mode does not depend on membership): zorro's
    cluster-aware regrouping inside each mini-batch gives the stock losses, grad norms and weights."""
    stock, zorro = _pair(base_model, use_dynamic_bsz=use_dynamic_bsz, mini=B, micro=5, max_token_len=60,
                         loss_agg_mode="seq-mean-token-mean")
    data = to_data_proto(_agentic_tensors())
    original = {k: v.clone() for k, v in data.batch.items()}
    ms, mz = stock.update_policy(data), zorro.update_policy(data)
    _assert_updates_equal(stock, zorro, ms, mz)
    assert mz["zorro/tree_depth"] == 3.0 and mz["zorro/dedup_ratio"] > 1.8 and mz["zorro/fallback_batches"] == 0
    assert all(torch.equal(v, data.batch[k]) for k, v in original.items())  # the caller's batch is untouched


def test_update_policy_token_mean_clusters_adjacent(base_model):
    """token-mean normalises each micro-batch by its own tokens: with clusters already adjacent (and fixed
    micro-batches on cluster boundaries) the membership is the stock one, so zorro equals stock exactly."""
    stock, zorro = _pair(base_model, loss_agg_mode="token-mean", mini=B, micro=3)
    # rows 0..8: the system cluster (3 micro-batches of 3), 9..14: the two trajectories (one micro-batch each)
    data = to_data_proto(_agentic_tensors(list(range(B))))
    ms, mz = stock.update_policy(data), zorro.update_policy(data)
    _assert_updates_equal(stock, zorro, ms, mz)
    assert mz["zorro/tree_depth"] >= 2.0


@pytest.mark.parametrize("budget", [60, 30], ids=["clusters_whole", "cluster_cut"])
def test_dynamic_budget_counts_shared_tokens_once(base_model, plans, budget):
    """The dynamic budget is the trees' tokens: every micro-batch's plan runs at most ``budget`` tokens while
    holding more ordinary tokens than that (shared prefixes counted once); clusters stay whole where they fit (the
    system cluster's tree is 55 tokens), and a budget below a cluster's tree cuts it (counted) and stays exact."""
    from zorro_verl.integrations.verl.v07.actor import row_units
    from zorro_verl.packing import build_plan
    from zorro_verl.packing.microbatch import dynamic_microbatches

    stock, zorro = _pair(base_model, use_dynamic_bsz=True, mini=B, max_token_len=budget,
                         loss_agg_mode="seq-mean-token-mean")
    tensors = _agentic_tensors()
    R = tensors["responses"].shape[1]
    g, p, r, r_split = row_units(tensors["input_ids"], tensors["attention_mask"], R, "prefix", 4)
    mbs = dynamic_microbatches(g, p, r, budget, split_response_lens=r_split)
    for rows, cost in zip(mbs.batches, mbs.costs):
        idx = torch.tensor(rows)
        plan = build_plan(tensors["input_ids"][idx], tensors["attention_mask"][idx], R, sharing="prefix",
                          min_shared_len=4)
        assert plan.T <= cost <= budget
        if mbs.split_groups == 0:
            assert plan.T == cost  # a whole cluster costs exactly its tree's tokens
    assert (mbs.split_groups == 0) == (budget == 60)

    data = to_data_proto(tensors, use_dynamic_bsz=True, max_token_len=budget)
    mask = data.batch["response_mask"].bool()
    _assert_logprobs_equal(stock.compute_log_prob(data, calculate_entropy=True),
                           zorro.compute_log_prob(data, calculate_entropy=True), mask)
    assert all(t <= budget for t, *_ in plans) and any(o > budget for _, o, _, _ in plans)
    assert len(plans) == len(mbs) and zorro.zorro_metrics()["zorro/split_groups"] == mbs.split_groups
    plans.clear()
    ms, mz = stock.update_policy(data), zorro.update_policy(data)
    _assert_updates_equal(stock, zorro, ms, mz)
    # the update's forwards (one mini-batch = the whole batch) use the same packing
    assert len(plans) == len(mbs) and all(t <= budget for t, *_ in plans)
    assert mz["zorro/split_groups"] == mbs.split_groups


def test_prefix_shares_what_prompt_sharing_cannot(base_model):
    """One sample per question behind the shared system prompt: no identical prompts, so sharing=prompt runs the
    parent's micro-batches at ratio 1; the tree still computes the system prompt once, exactly."""
    Stock, Zorro = _classes()
    stock = make_actor(Stock, base_model, make_actor_config())
    prompt = make_actor(Zorro, base_model, make_actor_config(zorro=ZORRO_ON))
    prefix = make_actor(Zorro, base_model, make_actor_config(zorro=PREFIX_ON))
    rows9 = [0, 3, 6]  # one sample of each question
    data = to_data_proto({k: v[rows9] for k, v in _agentic_tensors(list(range(B))).items()}, micro=3)
    mask = data.batch["response_mask"].bool()
    ref = stock.compute_log_prob(data, calculate_entropy=True)
    _assert_logprobs_equal(ref, prompt.compute_log_prob(data, calculate_entropy=True), mask)
    _assert_logprobs_equal(ref, prefix.compute_log_prob(data, calculate_entropy=True), mask)
    assert prompt.zorro_metrics()["zorro/dedup_ratio"] == 1.0
    m = prefix.zorro_metrics()
    assert m["zorro/dedup_ratio"] == pytest.approx(3 * 17 / (10 + 3 * 7), rel=1e-12) and m["zorro/tree_depth"] == 2.0


def test_hybrid_model_tree_matches_stock():
    """A hybrid linear-attention model (Qwen3.5: gated delta-net + full attention) carries its recurrent and conv
    state down the tree. The stock reference runs padded rows (its remove-padding path packs rows into one
    sequence, which transformers' CPU gated delta-net cannot separate)."""
    from zorro_verl.testing import tiny_hybrid_model

    model = tiny_hybrid_model("qwen3_5", dtype=torch.float32, seed=0, exact=False)
    Stock, Zorro = _classes()
    stock = make_actor(Stock, model, make_actor_config(use_remove_padding=False, mini=B, micro=5))
    zorro = make_actor(Zorro, model, make_actor_config(zorro=PREFIX_ON, mini=B, micro=5))
    stock._initial = [p.detach().clone() for p in stock.actor_module.parameters()]
    data = to_data_proto(_agentic_tensors(), micro=5)
    _assert_logprobs_equal(stock.compute_log_prob(data, calculate_entropy=True),
                           zorro.compute_log_prob(data, calculate_entropy=True), data.batch["response_mask"].bool())
    ms, mz = stock.update_policy(data), zorro.update_policy(data)
    _assert_updates_equal(stock, zorro, ms, mz)
    assert mz["zorro/tree_depth"] >= 2.0 and mz["zorro/dedup_ratio"] > 1.5 and mz["zorro/fallback_batches"] == 0
