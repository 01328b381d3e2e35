"""The zorro value-head (critic) engine vs verl 0.9.1's stock FSDPEngineWithValueHead on CPU (fp32, 1-rank gloo),
under FSDP2 and FSDP1 (the ``strategy`` fixture).

Each case runs two steps, as the trainer does: ``compute_values`` (the inference pass), then ``update_critic``
(verl's ``value_loss`` with value clipping, one SGD step), on the weights of the previous step. Tolerances
(docs/design/testing.md): values max abs <= 1e-5 at the positions verl reads; value loss, grad norm and every
gradient relative <= 1e-5.
"""

import pytest

pytestmark = pytest.mark.usefixtures("verl_cpu")  # skips without verl 0.9

ATOL = 1e-5
RTOL = 1e-5


@pytest.fixture(scope="session")
def tiny_value_ckpt(tmp_path_factory):
    from tests.support.verl_engines import value_ckpt

    return value_ckpt(tmp_path_factory.mktemp("tiny_qwen3_value"))


def _batches(dynamic, rmpad):
    from tests.support.verl_engines import make_value_batch

    # 3 prompts over 12 shuffled rows, uneven prompt / response lengths; micro-batch size 3 / token budget 40 force
    # several micro-batches, which zorro regroups by prompt
    return [make_value_batch(batch_size=12, num_prompts=3, prompt_len=7, response_len=6, seed=seed,
                             use_dynamic_bsz=dynamic, micro_batch_size=3, max_token_len=40, use_remove_padding=rmpad)
            for seed in (3, 4)]


@pytest.mark.parametrize("dynamic, rmpad, agg, sharing", [(False, True, "token-mean", "prompt"),
                                                           (True, False, "seq-mean-token-mean", "prompt"),
                                                           (False, True, "token-mean", "prefix")])
def test_critic_steps_match_stock(verl_cpu, tiny_value_ckpt, strategy, dynamic, rmpad, agg, sharing):
    from tests.support.verl_engines import (
        STEPS_OPTIM,
        assert_value_steps_match,
        build_engine,
        run_steps,
        value_loss_fn,
        value_step_errors,
    )
    from zorro_verl.integrations.verl.v09.value_engine import ZorroFSDPEngineWithValueHead

    batches = _batches(dynamic, rmpad)
    runs = {}
    for z in (False, True):
        settings = {"sharing": "prefix", "min_shared_len": 1} if sharing == "prefix" else None
        eng = build_engine(tiny_value_ckpt, zorro=z, model_type="value_model", strategy=strategy, micro_batch_size=3,
                           max_token_len=40, use_remove_padding=rmpad, optim_overrides=STEPS_OPTIM,
                           zorro_settings=settings)
        assert isinstance(eng, ZorroFSDPEngineWithValueHead) == z
        runs[z] = run_steps(eng, batches, value_loss_fn(agg))
    errs = value_step_errors(runs[False], runs[True], batches)
    assert_value_steps_match(errs, ATOL, RTOL)
    for step in runs[True]:
        for m in (step["inf"]["metrics"], step["tr"]["metrics"]):
            assert m["zorro/dedup_ratio"][0] > 1.0 and m["zorro/prompt_tokens_saved"][0] > 0
    if sharing == "prefix":
        assert runs[True][0]["inf"]["metrics"]["zorro/tree_depth"][0] >= 1
    print("critic", strategy, dynamic, rmpad, agg, sharing, errs)


def test_critic_ulysses_sp2_matches_stock(verl_cpu, tiny_value_ckpt, tmp_path_factory):
    """The zorro critic with Ulysses SP = 2 (two processes, one SP group) against verl's stock critic without SP,
    FSDP2 and FSDP1, two steps each: values, value loss, grad norm and every gradient (tests/support/
    verl_critic_ulysses.py runs each rank)."""
    from tests.support import HANG_TIMEOUT_S
    from tests.support.multi_rank import run_ranks
    from tests.support.verl_engines import STRATEGIES, assert_value_steps_match

    results = run_ranks("tests.support.verl_critic_ulysses", 2, [tiny_value_ckpt, 2],
                        tmp_path_factory.mktemp("critic_sp2"), HANG_TIMEOUT_S)
    for res in results:
        for strategy in STRATEGIES:
            r = res[strategy]
            assert r["dedup_ratio"] > 1.0
            assert_value_steps_match(r["errors"], ATOL, RTOL)
            print("critic sp2", res["rank"], strategy, r)


def test_critic_warn_falls_back_to_the_stock_value_forward(verl_cpu, tiny_value_ckpt):
    """``on_unsupported=warn`` on a batch zorro refuses (position ids shifted by one: not verl's text layout) runs
    verl's stock value-head forward (through the MRO to ``FSDPEngineWithValueHead``) and counts the batch; the values
    and the training step equal the stock critic's on the same batch."""
    import torch

    from tests.support.verl_engines import (
        STEPS_OPTIM,
        build_engine,
        make_value_batch,
        run_steps,
        value_loss_fn,
        value_step_errors,
    )

    td = make_value_batch(batch_size=8, num_prompts=2, prompt_len=6, response_len=5, seed=7, micro_batch_size=4)
    pos = td["position_ids"]
    td["position_ids"] = torch.nested.nested_tensor_from_jagged(pos.values() + 1, pos.offsets())
    runs = {z: run_steps(build_engine(tiny_value_ckpt, zorro=z, model_type="value_model", micro_batch_size=4,
                                      optim_overrides=STEPS_OPTIM, zorro_settings={"on_unsupported": "warn"}),
                         [td], value_loss_fn())
            for z in (False, True)}
    (e,) = value_step_errors(runs[False], runs[True], [td])
    assert e["fallback"] == [1.0, 1.0]
    assert e["values_scale"] > 0.1 and e["values"] <= ATOL
    assert abs(e["loss"][0] - e["loss"][1]) <= RTOL * abs(e["loss"][0]) and e["grad_rel"] <= RTOL
