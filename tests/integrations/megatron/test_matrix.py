"""A pairwise configuration matrix of zorro's Megatron engine vs verl 0.9.1's stock Megatron engine, fp32 on the CPU
(docs/design/testing.md "Configuration matrices", docs/verl-megatron.md).

The factors — builder (Megatron-Bridge, vanilla mbridge) x TP (1, 2) x sequence parallel x PP (1, 2) x VPP x
``use_dynamic_bsz`` x sharing (prompt, prefix) x model (dense Qwen3, Qwen3-MoE EP = 1, EP = 2) x LoRA x
``use_fused_kernels`` — with their constraints (SP needs TP = 2, VPP needs PP = 2, LoRA needs Megatron-Bridge) are
in tests/support/megatron_matrix.py; tests/support/covering.py generates a strength-2 covering array of them
(deterministic greedy): every allowed pair of two factors' values occurs in at least one case (asserted, and its
size). The cases run grouped by world size, each group in one gloo process group started once
(tests/support/megatron_matrix_ranks.py): per case verl's stock engine (padded bshd path, megatron's own attention,
non-fused head: no project code) and zorro's engine from the same checkpoint, the same GRPO batch, ``infer_batch``
and two SGD ``train_batch`` steps. A case either equals the stock engine within test_engine.py's tolerances or is
refused by name with a refusal listed in docs/refusals.md (:data:`EXPECTED_REFUSALS`).
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed here (run scripts/test_megatron.sh: "
                                            ".venv-megatron)")

from tests.support.megatron_matrix import (  # noqa: E402
    CASES,
    FACTORS,
    WORLDS,
    allowed,
    case_name,
    dp_of,
    world_of,
)

# test_engine.py's tolerances (fp32): values absolute, loss / grad norm relative, gradients relative to each
# parameter's largest entry (1e-5 at the second step: the weights already differ by a step's rounding), parameters
# after one SGD step (lr 1e-3) absolute, twice that after two
TOL_VALUE = 2e-6
TOL_SCALAR_REL = 1e-6
TOL_GRAD = {1: 5e-6, 2: 1e-5}
TOL_PARAM = {1: 1e-7, 2: 2e-7}
#: the generator's size for these factors and constraints (a change of either must be deliberate)
N_CASES = 11

#: the cases zorro must refuse: ``{zorro_verl.refusals key: (predicate on the case, why)}`` (none today: every case
#: runs and equals the stock engine)
EXPECTED_REFUSALS: dict = {}


def expected_refusal(case: dict):
    """The key of the refusal this case must raise, or None (it must equal the stock engine)."""
    for key, (pred, _why) in EXPECTED_REFUSALS.items():
        if pred(case):
            return key
    return None


def test_covering_array():
    from tests.support.covering import uncovered_pairs

    assert not uncovered_pairs(FACTORS, allowed, CASES)
    assert all(allowed(c) for c in CASES)
    assert len(CASES) == N_CASES, len(CASES)
    assert len({case_name(c) for c in CASES}) == len(CASES)
    print(f"Megatron engine matrix: {len(CASES)} cases over {len(FACTORS)} factors, worlds "
          + ", ".join(f"{w}: {sum(world_of(c) == w for c in CASES)} cases" for w in WORLDS))


@pytest.fixture(scope="module")
def matrix_results(tmp_path_factory):
    """Each world's group once: ``{case name: [rank results]}``."""
    from tests.support import HANG_TIMEOUT_S
    from tests.support.multi_rank import run_ranks

    tmp = tmp_path_factory.mktemp("megatron_matrix")
    out = {}
    for world in WORLDS:
        d = tmp / f"world{world}"
        d.mkdir()
        ranks = run_ranks("tests.support.megatron_matrix_ranks", world, [str(tmp / "ckpt")], d,
                          timeout_s=HANG_TIMEOUT_S)
        for name in ranks[0]:
            out[name] = [r[name] for r in ranks]
    return out


@pytest.mark.parametrize("case", CASES, ids=case_name)
def test_case(matrix_results, case):
    import os

    from zorro_verl.refusals import REFUSALS

    name = case_name(case)
    results = matrix_results[name]
    print(f"{name} (world {world_of(case)}, {max(r['seconds'] for r in results):.0f} s)")
    if "skipped" in results[0]:  # its builder is not installed
        if os.environ.get("ZORRO_REQUIRE_MEGATRON_BRIDGE") == "1":
            pytest.fail(f"{results[0]['skipped']} (scripts/setup_megatron_env.sh installs it)")
        pytest.skip(results[0]["skipped"])
    refusal = expected_refusal(case)
    if refusal is not None:
        phrase = {r.key: r.phrase for r in REFUSALS}[refusal]
        for rank, r in enumerate(results):
            assert "error" in r and phrase in r["error"], (rank, r.get("error"), r.get("traceback"))
        return
    outputs = 0
    for rank, r in enumerate(results):
        assert "error" not in r, (rank, r["error"], r["traceback"])
        for side in ("stock", "zorro"):  # the case was built as named
            b = r["built"][side]
            assert b["vanilla"] == (case["builder"] == "mbridge"), (side, b)
            assert (b["tp"], b["pp"], b["dp"]) == (case["tp"], case["pp"], dp_of(case)), (side, b)
            assert b["sp"] == case["sp"] and b["chunks"] == (2 if case["vpp"] else 1), (side, b)
            assert b["ep"] == (2 if case["model"] == "moe_ep2" else 1), (side, b)
            assert (b["routers"] > 0) == (case["model"] != "dense"), (side, b)
            assert (b["lora_trainable"] > 0) == case["lora"], (side, b)
            if case["lora"]:
                assert b["trainable"] == b["lora_trainable"] < b["params"], (side, b)  # the base is frozen
        assert r["built"]["zorro"]["fused"] == case["fused"] and r["built"]["zorro"]["zorro_reason"] is None, r
        assert r["init_params"] == 0.0, (rank, r)  # both engines start from the same weights (and adapters)
        assert r["grad_chunks"] == (["chunk0", "chunk1"] if case["vpp"] else ["chunk0"]) and r["n_grads"] > 0, r
        for step in (1, 2):
            assert r[f"step{step}/grad_rel"] <= TOL_GRAD[step], (rank, step, r)
            assert r[f"step{step}/params"] <= TOL_PARAM[step], (rank, step, r)
            if f"step{step}/grad_norm_rel" in r:
                assert r[f"step{step}/grad_norm_rel"] <= TOL_SCALAR_REL, (rank, step, r)
        if "log_probs" in r:  # a rank with outputs (PP: the last stage)
            outputs += 1
            assert r["log_probs"] <= TOL_VALUE and r["entropy"] <= TOL_VALUE, (rank, r)
            assert r["fallback"] == 0.0 and r["dedup_ratio"] > 1.0, (rank, r)
            for step in (1, 2):
                assert r[f"step{step}/loss_rel"] <= TOL_SCALAR_REL, (rank, step, r)
                assert r[f"step{step}/train_fallback"] == 0.0, (rank, step, r)
            # each DP rank's share of the batch's 38 response tokens
            assert r["n_tokens"] > 0
        print(f"  rank {rank}: " + ", ".join(f"{k} {v:.2g}" for k, v in r.items()
                                             if isinstance(v, float) and "fallback" not in k))
    assert outputs == world_of(case) // case["pp"]  # every rank of the last stage
    assert any("step1/grad_norm_rel" in r for r in results)
