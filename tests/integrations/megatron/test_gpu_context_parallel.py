"""Context parallelism on a GPU with Transformer Engine (docs/design/megatron.md "Context parallelism"): zorro's CP
(each rank its share of the packed row, keys / values all-gathered) against **stock CP** — verl's THD zigzag layout
and Transformer Engine's CP attention — both bf16 at CP = 2, by the relative rule against an fp32 CP = 1 reference
(megatron's ordinary forward): zorro's log-probs within 2x stock CP's error, gradients within 3x; and the same through
verl's Megatron engine (Megatron-Bridge, TE spec): zorro's engine vs verl's stock engine at CP = 2. Two processes,
one GPU each (NCCL); skipped with fewer than 2 GPUs, without megatron-core or Transformer Engine
(scripts/gpu_check.sh runs it). Megatron's local attention has no CP, so on the CPU the stock side is megatron's
ordinary forward at CP = 1 (test_context_parallel.py)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

pytest.importorskip("megatron.core", reason="megatron-core is not installed here")
pytest.importorskip("transformer_engine", reason="Transformer Engine is not installed here")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (one per CP rank)")
def test_zorro_cp_vs_stock_te_cp(tmp_path):
    from tests.support import HANG_TIMEOUT_S
    from tests.support.multi_rank import run_ranks

    for rank, r in enumerate(run_ranks("tests.support.megatron_gpu_cp_ranks", 2, [], tmp_path,
                                       min(HANG_TIMEOUT_S, 600))):
        print(f"rank {rank}: zorro CP log-probs sdpa {r['lp']:.2e} / flash_copyfree {r['lp_flash']:.2e} (stock TE "
              f"CP {r['lp_stock']:.2e}), grads {r['grad']:.2e} / {r['grad_flash']:.2e} (stock {r['grad_stock']:.2e})")
        for lp, grad in ((r["lp"], r["grad"]), (r["lp_flash"], r["grad_flash"])):  # dense and varlen CP attention
            assert lp <= 2 * r["lp_stock"], r
            assert grad <= 3 * r["grad_stock"], r


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (one per CP rank)")
def test_zorro_engine_cp_vs_stock_engine_te_cp(tmp_path):
    """verl's Megatron engine at CP = 2 (Megatron-Bridge, TE spec, bf16, ordinary loss regime): zorro's engine against
    verl's stock engine with TE's CP attention (tests/support/megatron_gpu_engine_cp_ranks.py): log-probs against HF
    fp32 within 2x stock CP's error, gradients against stock CP within 3x stock CP's own bf16 noise (floored at
    bf16's unit roundoff, 2^-8)."""
    pytest.importorskip("megatron.bridge", reason="Megatron-Bridge is not installed here")
    pytest.importorskip("verl", reason="verl is not installed here")
    from tests.support import HANG_TIMEOUT_S
    from tests.support.multi_rank import run_ranks

    for rank, r in enumerate(run_ranks("tests.support.megatron_gpu_engine_cp_ranks", 2, [str(tmp_path / "ckpt")],
                                       tmp_path, min(HANG_TIMEOUT_S, 600))):
        print(f"rank {rank}: zorro engine CP=2 log-probs {r['lp']:.2e} (stock TE CP {r['lp_stock']:.2e}) vs HF fp32; "
              f"gradients zorro vs stock {r['grad']:.2e} (stock's own noise {r['grad_noise']:.2e})")
        assert not r["per_token_loss"] and r["fallback"] == 0.0, r
        assert r["lp"] <= 2 * r["lp_stock"], r
        assert r["grad"] <= 3 * max(r["grad_noise"], 2.0 ** -8), r
