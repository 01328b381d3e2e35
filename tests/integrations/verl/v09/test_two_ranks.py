"""Two DP ranks (two processes, gloo), under FSDP2 and FSDP1: the zorro engine with 4-row logits chunks in modes memory
and compute, with a LoRA adapter, and with verl's fused kernels, equals the stock engine on each rank over two
optimizer steps; a batch that only one rank cannot run makes both ranks run the stock forward, and a batch that only
one rank cannot read or split makes both ranks raise. Both strategies run in the same two processes
(tests/support/verl_two_ranks.py), once per module. A hang fails the tests (timeout) instead of blocking the suite.

Under FSDP1 the fused step failed here before its forward was set inside the FSDP1 wrapper (the wrapper's own
forward, which unshards the root unit's sharded parameters, was skipped).

Tolerances (docs/design/testing.md, fp32): log-probs / entropy max abs <= 1e-5; loss, grad norm, gradients relative
<= 1e-5.
"""

import pytest

from tests.support import HANG_TIMEOUT_S  # a hang guard, never a speed check

pytestmark = pytest.mark.usefixtures("verl_cpu")  # skips without verl 0.9

ATOL = 1e-5
RTOL = 1e-5


@pytest.fixture(scope="module")
def results(tiny_ckpt, tmp_path_factory):
    """Both ranks' results (both strategies), from one run of the two processes."""
    from tests.support.multi_rank import run_ranks

    return run_ranks("tests.support.verl_two_ranks", 2, [tiny_ckpt], tmp_path_factory.mktemp("two_ranks"),
                     HANG_TIMEOUT_S)


def test_two_ranks_memory_and_compute_match_stock(results, strategy):
    from tests.support.verl_engines import assert_steps_match

    assert [r["rows"] for r in results] == [[8, 8], [12, 12]]  # different row counts per rank
    for mode in ("memory", "compute"):
        rs = [r[strategy][mode] for r in results]
        assert rs[0]["micro_batches"] == rs[1]["micro_batches"]
        for r in rs:
            # memory: the head is its own FSDP unit (gathered around the chunk loop); compute under FSDP1: verl's
            # default wrap policy (the head sharded in the root unit)
            assert r["head_is_own_unit"] == (mode == "memory" or strategy == "fsdp2")
            assert r["max_rows_per_micro_batch"] > 4  # more response rows than one 4-row chunk
            assert_steps_match(r["steps"], ATOL, RTOL)
        for k in range(2):  # the global loss: both ranks' parts
            total_a, total_b = (sum(r["steps"][k]["loss"][i] for r in rs) for i in (0, 1))
            assert abs(total_a - total_b) <= RTOL * abs(total_a)
    for r in results:  # the unsupported batch of rank 0 sent both ranks down the stock path, with stock results
        assert r[strategy]["memory"]["consensus_fallback"] == [1.0]
        assert r[strategy]["memory"]["consensus_log_probs_max_abs"] <= ATOL


@pytest.mark.parametrize("mode", ["none", "memory"])
def test_two_ranks_lora_matches_stock(results, strategy, mode):
    """LoRA (all-linear, rank 8) on two ranks over two SGD steps, logits modes none and memory: the stock engine's
    log-probs, losses, grad norms and every gradient (the LoRA parameters')."""
    from tests.support.verl_engines import assert_steps_match

    for r in results:
        lora = r[strategy]["lora"][mode]
        assert_steps_match(lora["steps"], ATOL, RTOL)
        assert any("lora_A" in n for n in lora["grad_names"]) and any("lora_B" in n for n in lora["grad_names"])


def test_a_batch_one_rank_cannot_run_stops_every_rank(results):
    """Every check that can fail on one rank is agreed before the ranks branch: both raise (the failing rank its own
    error, the other quoting it), or with on_unsupported=warn both run the stock forward; none waits in a
    collective (the harness's timeout)."""
    r0, r1 = (r["one_rank_cannot_run"] for r in results)
    # rank 1's position ids do not count 0, 1, 2, ...: an unsupported setting (raise: both raise; warn: both stock)
    a, b = r0["positions_raise"], r1["positions_raise"]
    assert a["error"] == b["error"] == "ValueError", (a, b)
    assert "unsupported setting: position_ids" in b["message"] and "on_unsupported=warn" in b["message"]
    assert "the batch of rank 1 cannot run" in a["message"] and "position_ids" in a["message"]
    assert r0["positions_warn"] == r1["positions_warn"] == {"error": None, "fallback": [1.0]}
    # rank 0's token budget holds none of its rows: a batch zorro cannot split, raised on both ranks
    a, b = r0["budget"], r1["budget"]
    assert a["error"] == b["error"] == "ValueError", (a, b)
    assert a["message"].startswith("max_token_len: row") and "alone needs" in a["message"]
    assert "the batch of rank 0 cannot run" in b["message"] and "max_token_len: row" in b["message"]
    # rank 1 needs 12 micro-batches, rank 0 has 8 rows: both raise after agreeing on the count
    a, b = r0["count"], r1["count"]
    assert a["error"] == b["error"] == "ValueError", (a, b)
    assert a["message"] == b["message"] and "need 12 micro-batches" in a["message"] and "only 8 rows" in a["message"]


def test_two_ranks_fused_kernels_match_stock(results, strategy):
    """verl's fused kernels over two optimizer steps: against the stock engine without them (the same math), and
    under FSDP1 against verl's own fused engine, and with the head as its own FSDP1 unit."""
    from tests.support.verl_engines import assert_steps_match

    for r in results:
        assert_steps_match(r[strategy]["fused"]["steps"], ATOL, RTOL)
        if strategy == "fsdp":
            assert_steps_match(r[strategy]["fused"]["steps_vs_stock_fused"], ATOL, RTOL)
            assert_steps_match(r[strategy]["fused"]["steps_head_unit"], ATOL, RTOL)
