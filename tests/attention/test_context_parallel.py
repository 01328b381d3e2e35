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
        assert len(res) == 12, sorted(res)  # 2 plans x (GQA: 4 backends, window: the 2 dense ones)
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
    from zorro_verl.attention import AttentionFeatures

    plan = plans()["prompt"]
    q = torch.zeros(1, 2, plan.T, 8)
    with pytest.raises(ValueError, match="under context parallelism"):
        cp_attend(plan, "flex", cp_shard(plan, 1, 0), q, q, q, 1.0)
    with pytest.raises(ValueError, match="without windows, chunks or sinks; this layer has a window"):
        cp_attend(plan, "flash_copyfree", cp_shard(plan, 1, 0), q, q, q, 1.0, AttentionFeatures(window=3))


@pytest.mark.parametrize("name", ["prompt", "prefix"])
@pytest.mark.parametrize("cp", [2, 3])
def test_varlen_calls_compute_exactly_the_visible_pairs(name, cp):
    """The varlen CP attention's FLOPs are the causal share: on every rank, the (query, key) pairs its calls compute
    (the own call's bottom-right causal blocks, the ancestor calls' full blocks) are exactly the pairs the dense
    call's mask keeps for its valid queries, none twice; and every key a call reads is a key the mask keeps."""
    from tests.support.cp_attention_ranks import plans
    from zorro_verl.attention.context_parallel import cp_varlen_index, cp_visible_mask

    plan = plans()[name]
    for rank in range(cp):
        shard = cp_shard(plan, cp, rank)
        ix, mask = cp_varlen_index(plan, shard), cp_visible_mask(plan, shard)
        ql = ix["q_local"]
        seen = torch.zeros(ql.numel(), plan.T, dtype=torch.long)
        ki, cu_q, cu_k, _, _ = ix["own"]
        for s in range(cu_q.numel() - 1):
            q0, q1, k0, k1 = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
            lq, lk = q1 - q0, k1 - k0
            for i in range(lq):  # bottom-right causal: query i sees keys 0 .. lk - lq + i
                seen[q0 + i, ki[k0: k0 + lk - lq + i + 1]] += 1
        for qi, ka, cq, ck, _, _ in ix["ancestors"]:
            for s in range(cq.numel() - 1):
                for j in qi[int(cq[s]): int(cq[s + 1])].tolist():
                    seen[j, ka[int(ck[s]): int(ck[s + 1])]] += 1
        assert seen.max() == 1
        assert torch.equal(seen.bool(), mask[ql]), (name, cp, rank)
