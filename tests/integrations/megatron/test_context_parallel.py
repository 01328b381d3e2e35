"""Context parallelism on megatron-core's ``GPTModel`` (fp64, gloo; tests/support/megatron_cp_ranks.py): zorro at
CP = 2 — each rank its zigzag share of the packed row, keys / values all-gathered — equal to megatron's ordinary
forward at CP = 1 and to zorro at CP = 1 on the same batch and loss (log-probs, entropy, every parameter's gradient
summed over the CP group), prompt and prefix-tree plans; CP = 2 x TP = 2 + sequence parallelism in 4 processes
(``ZORRO_MEGATRON_4RANKS=0`` skips it). Megatron's local attention has no CP: the stock CP comparison (Transformer
Engine's CP attention) is a GPU test (test_gpu_context_parallel.py)."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed here (run scripts/test_megatron.sh: "
                                            ".venv-megatron)")

TOL = 1e-12


def _check(results, tp):
    for rank, res in enumerate(results):
        assert "no context-parallel exchange" in res.pop("refused"), rank
        assert set(res) == {"prompt", "prefix"}, res.keys()
        for sharing, r in res.items():
            where = (rank, sharing, r)
            for k in ("logprob", "entropy", "grad_rel", "vs_zorro_cp1_logprob", "vs_zorro_cp1_entropy",
                      "vs_zorro_cp1_grad_rel"):
                assert r[k] <= TOL, (k, where)
            assert r["ranks_equal"] and r["n"] == 15 and r["params"] == 15, where
            assert r["sp"] == (tp > 1) and r["L"] % tp == 0 and 2 * r["L"] >= r["T"], where
            assert r["kv_bytes"] == r["kv_bytes_formula"] > 0, where


def _timeout() -> int:
    return int(os.environ.get("ZORRO_MEGATRON_RANK_TIMEOUT", "900"))


def test_cp2_two_ranks(tmp_path):
    from tests.support.multi_rank import run_ranks

    _check(run_ranks("tests.support.megatron_cp_ranks", 2, [1], tmp_path, timeout_s=_timeout()), tp=1)


@pytest.mark.skipif(os.environ.get("ZORRO_MEGATRON_4RANKS", "1") == "0", reason="ZORRO_MEGATRON_4RANKS=0")
def test_cp2_tp2_sp_four_ranks(tmp_path):
    from tests.support.multi_rank import run_ranks

    _check(run_ranks("tests.support.megatron_cp_ranks", 4, [2], tmp_path, timeout_s=_timeout()), tp=2)
