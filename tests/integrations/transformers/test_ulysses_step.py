"""``zorro_step`` under Ulysses sequence parallelism (docs/design/verl.md) against ``zorro_step`` on the whole packed
row, without verl: every rank of an SP group runs its slice of the padded row, exchanges sequence shards for head
shards around the backend, runs the head at the rows it holds and all-gathers them (tests/support/ulysses_step.py).

CPU: SP = 2 in two processes over gloo, fp64, backend ``sdpa``, modes ``none`` and ``memory``, models with 2 and with
1 KV head (fewer KV heads than SP ranks), tiny gpt-oss (sliding windows, attention sinks sliced per rank's heads),
Gemma 2 (windows, soft-capping) and Llama 4 (chunk 4, the NoPE query temperature at floor_scale 2, applied from
the rank's slice of the positions), a packed row of odd length, a 1-token and an empty response:
log-probs, entropy and the gradient relative (Frobenius) <= 1e-12. Prefix trees and hybrid layers (the same two
processes; SP = 4 in four more, the two tree cases): a tree over a shared system prompt, responses sharing their
first tokens, an identical row and multi-output agent-loop samples with masked tool tokens on tiny Qwen3; Qwen3.5
and Qwen3-Next (one key head: repeated before the exchange), OLMo-hybrid (its three convs exchanged as one) and
MiniMax (lightning-attention heads exchanged) with the prompt plan, LFM2 (short-conv channels exchanged) with the
prompt plan and the tree, Qwen3.5 with the tree (trees also
with per-row temperatures: outputs sharing a head row divide it by their own). SP vs the
same plan without SP: relative (Frobenius) <= 1e-12; SP vs the ordinary per-row forward: log-probs / entropy
<= 1e-12 abs, gradients per parameter (floored at 1e-6 of the largest) <= 1e-9 for attention-only models
(test_tree_step.py's rule, tightened from 1e-8) and <= max(1e-12, 4x the oracle's own re-chunking error) for
hybrids (test_hybrid.py's).
GPU (``gpu``): SP = 2 over NCCL with two GPUs, else SP = 1 on one GPU (the exchange degenerates to a copy; the
shard, gather and backend path still run), bf16, backend ``flash``, by the relative rule against an fp64 ``sdpa``
oracle: the SP error <= 2x the non-SP bf16 error for log-probs / entropy, <= 3x for gradients.
"""

import pytest
import torch

from tests.support import HANG_TIMEOUT_S  # a hang guard, never a speed check

FP64_TOL = 1e-12
CASES = ("heads4", "heads2")
MODES = ("none", "memory")
TREE_CASES = ("tree_qwen3", "hybrid_qwen3_5", "hybrid_qwen3_next_k1", "hybrid_tree_qwen3_5", "hybrid_olmo_hybrid",
              "mixer_lfm2", "mixer_tree_lfm2", "mixer_minimax")
ORACLE_ABS_TOL = 1e-12
TREE_GRAD_TOL = 1e-9


def _check_trees_and_hybrids(r, cases=TREE_CASES):
    assert r["tree_qwen3"]["tree"] and r["hybrid_tree_qwen3_5"]["tree"]
    assert r["tree_qwen3"]["Nh"] < r["tree_qwen3"]["N"]  # shared predicting positions: the head once per position
    for case in cases:
        assert min(r[case]["rows_per_rank"]) >= 0 and sum(r[case]["rows_per_rank"]) == r[case]["N"]
        if r[case]["tree"]:  # per-row temperatures on a tree: each output's own divisor on the shared head row
            err = r[case]["per_row_temperature"]["sp_vs_ref"]
            assert max(err["log_probs"], err["entropy"], err["grads"]) <= FP64_TOL, (case, err)
        for mode in MODES:
            err, orc = r[case][mode]["sp_vs_ref"], r[case][mode]["sp_vs_oracle"]
            assert max(err["log_probs"], err["entropy"], err["grads"]) <= FP64_TOL, (case, mode, err)
            assert max(orc["log_probs_max_abs"], orc["entropy_max_abs"]) <= ORACLE_ABS_TOL, (case, mode, orc)
            bound = TREE_GRAD_TOL if "rechunk_per_param" not in orc else max(1e-12, 4 * orc["rechunk_per_param"])
            assert orc["grad_per_param"] <= bound, (case, mode, orc)
            print(f"{case} {mode}: SP vs no SP {max(err['log_probs'], err['entropy'], err['grads']):.1e}; vs "
                  f"ordinary abs {max(orc['log_probs_max_abs'], orc['entropy_max_abs']):.1e}, grad per param "
                  f"{orc['grad_per_param']:.1e} (bound {bound:.1e})")


def test_sp2_step_matches_whole_row_fp64(tmp_path):
    from tests.support.multi_rank import run_ranks

    results = run_ranks("tests.support.ulysses_step", 2, ["cpu", "all"], tmp_path, HANG_TIMEOUT_S)
    for r in results:
        _check_trees_and_hybrids(r)
        assert r["T"] % 2 == 1 and 0 in r["response_lens"] and 1 in r["response_lens"]
        assert r["heads2"]["kv_heads"] == 1 and r["heads4"]["kv_heads"] == 2
        for case in CASES:
            assert min(r[case]["rows_per_rank"]) > 0 and sum(r[case]["rows_per_rank"]) == r["N"]
            for mode in MODES:
                err = r[case][mode]["sp_vs_ref"]
                assert max(err["log_probs"], err["entropy"], err["grads"]) <= FP64_TOL, (case, mode, err)
        # windows, sinks, soft-capping; Llama 4's chunks and NoPE query temperature
        for kind, modes in (("gpt_oss", MODES), ("gemma2", ("none",)), ("llama4", ("none",))):
            for mode in modes:
                err = r[kind][mode]["sp_vs_ref"]
                assert max(err["log_probs"], err["entropy"], err["grads"]) <= FP64_TOL, (kind, mode, err)


def test_sp4_trees_and_hybrids_fp64(tmp_path):
    from tests.support.multi_rank import run_ranks

    for r in run_ranks("tests.support.ulysses_step", 4, ["cpu", "trees"], tmp_path, HANG_TIMEOUT_S):
        _check_trees_and_hybrids(r, ("tree_qwen3", "hybrid_tree_qwen3_5"))


@pytest.mark.gpu
def test_sp_step_bf16_relative_rule(tmp_path):
    from tests.support.multi_rank import run_ranks

    world = min(2, torch.cuda.device_count())
    results = run_ranks("tests.support.ulysses_step", world, ["cuda", "base"], tmp_path, HANG_TIMEOUT_S)
    for r in results:
        for case in CASES:
            for mode in MODES:
                ref, got = r[case][mode]["ref_vs_oracle"], r[case][mode]["sp_vs_oracle"]
                print(f"SP={world} {case} {mode}: bf16 error vs fp64, no SP {ref}, SP {got}")
                assert got["log_probs"] <= 2 * ref["log_probs"] and got["entropy"] <= 2 * ref["entropy"]
                assert got["grads"] <= 3 * ref["grads"]


VLM_CASES = ("vlm_qwen2_5_vl", "vlm_qwen3_vl", "vlm_tree_qwen3_vl", "vlm_qwen3_5")
#: Per-parameter gradient bound against each row alone (test_vision.py's; Qwen3.5: max(1e-12, 4x the oracle's own
#: re-chunking error), the hybrid rule of the cases above).
VLM_GRAD_TOL = 1e-10


def test_sp2_vision_language_fp64(tmp_path):
    """Vision-language models under SP = 2 (tests/support/ulysses_step.py ``_vlm_cases``): Qwen2.5-VL, Qwen3-VL
    (deepstack features cut with the row), Qwen3.5 (gated delta-net) and a Qwen3-VL prefix tree, images in prompts and
    responses, the slices meeting inside an image, a padded (odd) row. Every rank encodes the packed row's unique
    images (fewer than the ordinary rows') and the language model runs its slice: SP vs the same plan without SP
    relative (Frobenius) <= 1e-12; vs each row alone log-probs / entropy <= 1e-12 abs, gradients (the vision
    tower's too) per parameter <= 1e-10 (Qwen3.5: <= max(1e-12, 4x the oracle's re-chunking error))."""
    from tests.support.multi_rank import run_ranks

    results = run_ranks("tests.support.ulysses_step", 2, ["cpu", "vlm"], tmp_path, HANG_TIMEOUT_S)
    assert any(r[c]["T"] % 2 for r in results for c in VLM_CASES)  # a padded row
    for r in results:
        for case in VLM_CASES:
            c = r[case]
            assert c["boundaries_in_image"] == 1, (case, c["T"])  # rank 1's slice starts inside an image
            assert min(c["rows_per_rank"]) > 0 and sum(c["rows_per_rank"]) == c["N"]
            assert c["tree"] == ("tree" in case) and c["response_items"] > 0 and c["vision_grads"] > 0
            # each rank encodes the packed row's unique images once (the ordinary rows hold each 3 times)
            assert c["encoded"] == c["items"] < c["row_items"], (case, c)
            err, orc = c["none"]["sp_vs_ref"], c["none"]["sp_vs_oracle"]
            assert max(err["log_probs"], err["entropy"], err["grads"]) <= FP64_TOL, (case, err)
            assert max(orc["log_probs_max_abs"], orc["entropy_max_abs"]) <= ORACLE_ABS_TOL, (case, orc)
            bound = VLM_GRAD_TOL if "rechunk_per_param" not in orc else max(1e-12, 4 * orc["rechunk_per_param"])
            assert orc["grad_per_param"] <= bound, (case, orc, bound)
            print(f"{case} rank {results.index(r)} (T={c['T']}, images {c['encoded']} / {c['row_items']}): SP vs no "
                  f"SP {max(err['log_probs'], err['entropy'], err['grads']):.1e}; vs each row abs "
                  f"{max(orc['log_probs_max_abs'], orc['entropy_max_abs']):.1e}, grad per param "
                  f"{orc['grad_per_param']:.1e} (bound {bound:.1e}); {c['seconds']:.0f} s")
