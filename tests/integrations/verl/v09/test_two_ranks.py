"""Two DP ranks (two processes, gloo, FSDP2, untied lm_head as its own FSDP2 unit): the zorro engine with 4-row
logits chunks in modes memory and compute equals the stock engine on each rank, a batch that only one rank
cannot run makes both ranks run the stock forward, and a batch that only one rank cannot read or split makes both
ranks raise. One run of the two processes serves every test here. A hang fails the tests (timeout) instead of
blocking the suite.

Tolerances (docs/DESIGN.md §10, fp32): log-probs / entropy max abs <= 1e-5; loss, grad norm, gradients relative
<= 1e-5.
"""

import pytest

pytestmark = pytest.mark.usefixtures("verl_cpu")  # skips without verl 0.9

ATOL = 1e-5
RTOL = 1e-5
#: Seconds both ranks get before the test fails as a hang (a normal run takes well under half of it).
HANG_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def results(verl_cpu, tiny_ckpt, tmp_path_factory):
    from tests.support.multi_rank import run_ranks

    return run_ranks("tests.support.verl_two_ranks", 2, [tiny_ckpt], tmp_path_factory.mktemp("two_ranks"),
                     HANG_TIMEOUT_S)


def test_two_ranks_memory_and_compute_match_stock(results):
    assert [r["rows"] for r in results] == [8, 12]  # different row counts per rank
    for mode in ("memory", "compute"):
        rs = [r[mode] for r in results]
        assert rs[0]["micro_batches"] == rs[1]["micro_batches"]
        for r in rs:
            assert r["head_is_own_unit"]
            assert r["max_rows_per_micro_batch"] > 4  # more response rows than one 4-row chunk
            assert r["fallback"] == [0.0, 0.0]
            assert r["log_probs_max_abs"] <= ATOL and r["entropy_max_abs"] <= ATOL
            (la, lb), (ga, gb) = r["loss"], r["grad_norm"]
            assert abs(la) > 1e-4 and abs(la - lb) <= RTOL * abs(la)
            assert ga > 1e-4 and abs(ga - gb) <= RTOL * ga
            assert r["grad_rel"] <= RTOL
        total_a, total_b = (sum(r["loss"][i] for r in rs) for i in (0, 1))
        assert abs(total_a - total_b) <= RTOL * abs(total_a)
    for r in results:  # the unsupported batch of rank 0 sent both ranks down the stock path, with stock results
        assert r["memory"]["consensus_fallback"] == [1.0]
        assert r["memory"]["consensus_log_probs_max_abs"] <= ATOL


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
