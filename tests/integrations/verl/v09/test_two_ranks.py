"""Two DP ranks (two processes, gloo, FSDP2, untied lm_head as its own FSDP2 unit): the zorro engine with 4-row
logits chunks in modes memory and compute equals the stock engine on each rank, and a batch that only one rank
cannot run makes both ranks run the stock forward. A hang fails the test (timeout) instead of blocking the suite.

Tolerances (docs/DESIGN.md §10, fp32): log-probs / entropy max abs <= 1e-5; loss, grad norm, gradients relative
<= 1e-5.
"""

import pytest

pytestmark = pytest.mark.usefixtures("verl_cpu")  # skips without verl 0.9

ATOL = 1e-5
RTOL = 1e-5
#: Seconds both ranks get before the test fails as a hang (a normal run takes well under half of it).
HANG_TIMEOUT_S = 180


def test_two_ranks_memory_and_compute_match_stock(tiny_ckpt, tmp_path):
    from tests.support.multi_rank import run_ranks

    results = run_ranks("tests.support.verl_two_ranks", 2, [tiny_ckpt], tmp_path, HANG_TIMEOUT_S)
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
