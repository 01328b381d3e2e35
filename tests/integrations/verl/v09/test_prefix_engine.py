"""The zorro FSDP engine with ``sharing=prefix`` (prefix trees) vs verl 0.9.1's stock engine on CPU (FSDP2 and FSDP1,
fp32, 1-rank gloo): an agentic batch (a shared system prompt over several questions, plus multi-turn trajectories
emitted as one sample per turn with tool observations masked out of the loss). Tolerances as the engine suite:
log-probs / entropy max abs <= 1e-5; loss, grad norm and gradients relative <= 1e-5 (fp32)."""

import pytest

from tests.support.verl_engines import infer, output_values

pytestmark = pytest.mark.usefixtures("verl_cpu")  # skips without verl 0.9

ATOL = 1e-5
RTOL = 1e-5
PREFIX = {"sharing": "prefix", "min_shared_len": 4}


def _agentic_batch(**kw):
    from tests.support.verl_engines import make_engine_batch
    from zorro_verl.testing import batch_from_rows, multi_turn_rows, shared_system_rows

    rows = shared_system_rows(3, 3, system_len=10, question_len=3, response_len=4, vocab_size=100, seed=7)
    turns, masks = multi_turn_rows(3, first_prompt_len=5, turn_len=3, observation_len=2, vocab_size=100, seed=8)
    order = [4, 9, 0, 11, 2, 7, 5, 1, 10, 3, 6, 8]  # clusters interleaved
    rows, masks = rows + turns, [[1] * len(r) for _, r in rows] + masks
    base = batch_from_rows([rows[i] for i in order], response_masks=[masks[i] for i in order],
                           include_training_fields=True, seed=9)
    return make_engine_batch(base=base, **kw)


@pytest.fixture(scope="module")
def engines(verl_cpu, tiny_ckpt, strategy):
    from tests.support.verl_engines import build_engine

    return (build_engine(tiny_ckpt, zorro=False, strategy=strategy),
            build_engine(tiny_ckpt, zorro=True, zorro_settings=PREFIX, strategy=strategy))


@pytest.mark.parametrize("dynamic", [False, True])
def test_infer_matches_stock(engines, dynamic):
    stock, zorro = engines
    td = _agentic_batch(temperature=0.8, calculate_entropy=True, use_dynamic_bsz=dynamic, micro_batch_size=4,
                        max_token_len=60)
    a, b = infer(stock, td), infer(zorro, td)
    mask = td["attention_mask"][:, -td["responses"].shape[1]:].bool()
    lp_a, lp_b = output_values(a, td, "log_probs"), output_values(b, td, "log_probs")
    assert mask.sum() > 30 and lp_a[mask].abs().max() > 1.0
    assert (lp_a - lp_b)[mask].abs().max().item() <= ATOL
    ea, eb = output_values(a, td, "entropy"), output_values(b, td, "entropy")
    assert (ea - eb)[mask].abs().max().item() <= ATOL
    m = b["metrics"]
    assert m["zorro/tree_depth"][0] >= 3 and m["zorro/dedup_ratio"][0] > 1.5
    assert m["zorro/fallback_batches"] == [0.0]


def test_microbatches_keep_clusters_within_budget(engines):
    from zorro_verl.integrations.verl.v09.batching import row_lengths

    _, zorro = engines
    td = _agentic_batch(use_dynamic_bsz=True, max_token_len=60)
    mbs = zorro.zorro_micro_batches(td)
    assert sorted(b for mb in mbs.batches for b in mb) == list(range(12))
    assert mbs.split_groups == 0 and all(c <= 60 for c in mbs.costs)
    # shared tokens are counted once: a micro-batch holds more ordinary tokens than the budget
    p, r = row_lengths(td)
    assert any(int((p[mb] + r[mb]).sum()) > 60 for mb in mbs.batches)


@pytest.mark.parametrize("logits_mode", ["none", "memory"])
def test_train_step_matches_stock(verl_cpu, tiny_ckpt, strategy, logits_mode):
    """``memory``: the chunked head on the trees' distinct predicting positions, 4-row chunks (several per
    micro-batch; FSDP2 with the untied head as its own unit, FSDP1 with it in the root unit)."""
    from tests.support.verl_engines import build_engine, engine_grads, ppo_loss_fn
    from zorro_verl.testing import grad_rel_error

    td = _agentic_batch(temperature=0.9, calculate_entropy=True, use_dynamic_bsz=True, max_token_len=60)
    outs, grads = [], []
    for z in (False, True):
        eng = build_engine(tiny_ckpt, zorro=z, use_dynamic_bsz=True, max_token_len=60, strategy=strategy,
                           zorro_settings={**PREFIX, "logits_optimization": logits_mode} if z else None)
        if z:
            eng.logits_chunk_size = 4
        with eng.train_mode(zero_grad_on_exit=False):
            outs.append(eng.train_batch(td.clone(), loss_function=ppo_loss_fn()))
        grads.append(engine_grads(eng))
    a, b = outs
    loss_a, loss_b = sum(a["loss"]), sum(b["loss"])
    gn_a, gn_b = float(a["metrics"]["grad_norm"]), float(b["metrics"]["grad_norm"])
    assert abs(loss_a) > 1e-4 and gn_a > 1e-4
    assert abs(loss_a - loss_b) <= RTOL * abs(loss_a)
    assert abs(gn_a - gn_b) <= RTOL * gn_a
    assert grad_rel_error(*grads) <= RTOL
