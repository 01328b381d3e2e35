"""Zorro's split attention under context parallelism (attention/context_parallel.py): two gloo ranks, each holding
its zigzag share of the packed row, against the single-process split attention of the whole row, fp64 (outputs and
the gradients of q, k, v); the all-gather's bytes against the hand formula; at cp = 1 (no collective) in-process."""

import pytest
import torch

from tests.support import HANG_TIMEOUT_S
from tests.support.multi_rank import run_ranks
from zorro_verl.attention import attend
from zorro_verl.attention.context_parallel import cp_attend
from zorro_verl.packing.context_parallel import cp_shard

TOL = 1e-12


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_ranks("tests.support.cp_attention_ranks", 2, [], tmp_path_factory.mktemp("cp_attn"), HANG_TIMEOUT_S)


def test_two_ranks_equal_single_process_fp64(two_ranks):
    for rank, res in enumerate(two_ranks):
        assert len(res) == 8, sorted(res)  # 2 plans x 2 head / window layouts x 2 backends
        for key, r in res.items():
            for f in ("out", "dq", "dk", "dv"):
                assert r[f] <= TOL, (rank, key, f, r[f])
            assert r["pad_out"] == 0.0, (rank, key)
            # the all-gather of [k ; v] moved the other rank's L tokens of both, per layer call
            assert r["bytes"] == r["bytes_formula"] > 0, (rank, key, r)
            assert r["local_len"] * 2 >= r["T"]


def test_cp1_in_process_equals_attend():
    from tests.support.cp_attention_ranks import plans

    for plan in plans().values():
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, h, plan.T, 8, generator=g, dtype=torch.float64, requires_grad=True)
                   for h in (4, 2, 2))
        ref = attend(plan, "eager", q, k, v, 0.5)
        shard = cp_shard(plan, 1, 0)
        assert torch.equal(shard.index, torch.arange(plan.T))
        out = cp_attend(plan, "sdpa", shard, q, k, v, 0.5)
        assert float((out - ref).abs().max()) <= TOL
        w = torch.randn(ref.shape, generator=g, dtype=torch.float64)
        g_ref = torch.autograd.grad((ref * w).sum(), (q, k, v))
        g_cp = torch.autograd.grad((out * w).sum(), (q, k, v))
        for a, b in zip(g_ref, g_cp):
            assert float((a - b).abs().max()) <= TOL


def test_other_backends_refused():
    from tests.support.cp_attention_ranks import plans

    plan = plans()["prompt"]
    q = torch.zeros(1, 2, plan.T, 8)
    with pytest.raises(ValueError, match="under context parallelism"):
        cp_attend(plan, "flash", cp_shard(plan, 1, 0), q, q, q, 1.0)
