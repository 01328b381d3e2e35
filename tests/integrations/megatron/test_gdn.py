"""Zorro on a megatron-core hybrid ``GPTModel`` (Qwen3.5-shaped: a gated delta-net layer, then gated full attention)
vs megatron's ordinary forward, fp64 on the CPU (docs/design/megatron.md "Hybrid models", testing.md); and the CPU
stand-ins it runs on (tests/support/megatron_gdn.py) against independent references.

The model is built on the stand-in block spec (megatron's own hybrid block with CPU modules for TE's) with the
stand-in FLA kernels. The reference runs megatron's ``GatedDeltaNet`` and ``DotProductAttention`` on the right-padded
rows ``[prompt | response | pad]`` as one batch (each row's recurrence from a zero state; right padding cannot reach
an earlier token). zorro runs each prompt once and every response from its prompt's final recurrent state and conv
context. Compared: log-probs and entropy of every response token (1e-12 absolute) and every parameter's gradient of
the test loss (1e-12 relative to the parameter's largest entry), prompt and prefix sharing. TP = 1 in-process;
TP = 2 and TP = 2 + sequence parallelism in a 2-process gloo group (tests/support/megatron_gdn_ranks.py).
"""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed here (run scripts/test_megatron.sh: "
                                            ".venv-megatron)")

import torch  # noqa: E402

from tests.support import megatron_cpu as M  # noqa: E402
from tests.support import megatron_gdn as G  # noqa: E402
from zorro_verl.recurrent.packed import recurrent_gated_delta_rule_ref  # noqa: E402

TOL = 1e-12


def _inputs(seed: int, L: int, b: int = 1, H: int = 3, Dk: int = 5, Dv: int = 4, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(b, L, H, Dk, generator=g, dtype=dtype), dim=-1)
            for _ in range(2))
    v = torch.randn(b, L, H, Dv, generator=g, dtype=dtype)
    decay = -torch.rand(b, L, H, generator=g, dtype=dtype)
    beta = torch.rand(b, L, H, generator=g, dtype=dtype)
    return q, k, v, decay, beta


def test_standin_delta_rule_segments_and_states():
    """The stand-in ``chunk_gated_delta_rule`` with ``cu_seqlens`` (segments longer than a chunk, one of 1 token) and
    one initial state per segment equals the step-by-step definition run on each segment alone (fp64)."""
    cu = [0, 70, 71, 100]
    q, k, v, decay, beta = _inputs(0, cu[-1])
    h0 = torch.randn(3, 3, 5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    o, s = G.chunk_gated_delta_rule(q, k, v, decay, beta, initial_state=h0, output_final_state=True,
                                    cu_seqlens=torch.tensor(cu))
    for i, (a, e) in enumerate(zip(cu[:-1], cu[1:])):
        o_ref, s_ref = recurrent_gated_delta_rule_ref(*(t[:, a:e] for t in (q, k, v, decay, beta)),
                                                      initial_state=h0[i:i + 1], output_final_state=True)
        assert (o[:, a:e] - o_ref).abs().max() <= TOL and (s[i:i + 1] - s_ref).abs().max() <= TOL


def test_standin_delta_rule_vs_megatron_torch_kernel():
    """... and equals megatron's own torch kernel (``torch_chunk_gated_delta_rule``: fp32, whole rows) in fp32."""
    from megatron.core.ssm.gated_delta_net.common import torch_chunk_gated_delta_rule

    q, k, v, decay, beta = _inputs(2, 90, b=2, dtype=torch.float32)
    o, _ = G.chunk_gated_delta_rule(q, k, v, decay, beta)
    o_ref, _ = torch_chunk_gated_delta_rule(q, k, v, decay, beta)
    assert (o - o_ref).abs().max() <= 1e-5


def test_standin_causal_conv():
    """The stand-in ``causal_conv1d`` on a ``cu_seqlens`` row equals ``torch.nn.Conv1d``'s causal conv (megatron's
    deterministic path) on each segment alone, with and without the SiLU."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 11, 6, generator=gen, dtype=torch.float64)
    w, b = torch.randn(6, 4, generator=gen, dtype=torch.float64), torch.randn(6, generator=gen, dtype=torch.float64)
    for act in (None, "silu"):
        y, _ = G.causal_conv1d(x, w, b, activation=act, cu_seqlens=torch.tensor([0, 2, 11]))
        for a, e in ((0, 2), (2, 11)):
            ref = torch.nn.functional.conv1d(x[0, a:e].t()[None], w[:, None], b, padding=3, groups=6)[0, :, :e - a].t()
            ref = torch.nn.functional.silu(ref) if act else ref
            assert (y[0, a:e] - ref).abs().max() <= TOL


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    warnings.filterwarnings("ignore", message="GPTModel IS DEPRECATED")
    M.init_megatron(0, 1, str(tmp_path_factory.mktemp("rdv") / "init"))
    stock = G.build_hybrid_gpt(zorro=False)
    zorro = G.build_hybrid_gpt(zorro=True)
    zorro.load_state_dict(stock.state_dict())
    return stock, zorro


@pytest.mark.parametrize("sharing", ["prompt", "prefix"])
def test_hybrid_exact(hybrid, sharing):
    from zorro_verl.integrations.megatron import zorro_attention_modules
    from zorro_verl.integrations.megatron.gdn import ZorroGatedDeltaNet

    stock, zorro = hybrid
    assert sum(isinstance(m, ZorroGatedDeltaNet) for m in zorro_attention_modules(zorro)) == 1
    stock.zero_grad(set_to_none=True)
    zorro.zero_grad(set_to_none=True)
    ids, am, R = M.make_batch(shared_prefix=sharing == "prefix")
    s = M.stock_outputs(stock, ids, am, R)
    lp, ent, plan = M.zorro_outputs(zorro, ids, am, R, sharing=sharing)
    assert plan.T < plan.ordinary_tokens and lp.numel() == plan.N == 15
    if sharing == "prefix":
        assert plan.tree is not None
    res = M.compare(s, (lp, ent), M.grads(stock), M.grads(zorro))
    assert res["params"] == len(list(zorro.parameters()))
    print(f"zorro vs megatron, hybrid (gated delta-net + attention) fp64, {sharing} sharing: {res}")
    assert res["logprob"] <= TOL and res["entropy"] <= TOL and res["grad_rel"] <= TOL, res


@pytest.mark.parametrize("recompute", [
    {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}], ids=["full"])
def test_hybrid_recompute(hybrid, recompute):
    """megatron's full activation recomputation re-runs the zorro gated delta-net in backward with the captured plan:
    gradients stay exact. (The GDN's selective ``gdn_norm_out`` uses megatron's ``CheckpointWithoutOutput``, which
    needs Transformer Engine: not runnable on the CPU.)"""
    stock, _ = hybrid
    zorro = G.build_hybrid_gpt(zorro=True, config=recompute)
    zorro.load_state_dict(stock.state_dict())
    stock.zero_grad(set_to_none=True)
    ids, am, R = M.make_batch()
    s = M.stock_outputs(stock, ids, am, R)
    lp, ent, _ = M.zorro_outputs(zorro, ids, am, R)
    res = M.compare(s, (lp, ent), M.grads(stock), M.grads(zorro))
    print(f"zorro vs megatron, hybrid fp64, recompute {recompute['recompute_granularity']}: {res}")
    assert res["logprob"] <= TOL and res["entropy"] <= TOL and res["grad_rel"] <= TOL, res


def test_hybrid_plain_gdn_refused(hybrid):
    """A gated delta-net left ordinary in an installed model would run its recurrence across the packed row's
    segments: the step refuses it."""
    from zorro_verl.integrations.megatron import zorro_gpt_step
    from zorro_verl.packing import build_plan

    _, zorro = hybrid
    mixer = zorro.decoder.layers[0].self_attention
    cls = type(mixer)
    mixer.__class__ = cls.__mro__[2]  # megatron's GatedDeltaNet (behind the zorro mixin)
    try:
        ids, am, R = M.make_batch()
        with pytest.raises(ValueError, match="a gated delta-net without zorro's packed"):
            zorro_gpt_step(zorro, build_plan(ids, am, R))
    finally:
        mixer.__class__ = cls


def test_hybrid_two_ranks_tp_sp(tmp_path):
    """TP = 2 (each rank 2 of the 4 gated delta-net value heads, 2 of the 4 attention heads) and TP = 2 + sequence
    parallelism (the row padded to even length: the pad token's mixer output is zero), prompt and prefix plans, in a
    2-process gloo group (tests/support/megatron_gdn_ranks.py): each rank's log-probs / entropy and every gradient
    shard against megatron's ordinary forward."""
    import os

    from tests.support.multi_rank import run_ranks

    results = run_ranks("tests.support.megatron_gdn_ranks", 2, [], tmp_path, timeout_s=int(os.environ.get(
        "ZORRO_MEGATRON_RANK_TIMEOUT", "600")))
    for rank, per_case in enumerate(results):
        assert set(per_case) == {"tp2", "tp2_sp", "tp2_sp_prefix"}
        for case, res in per_case.items():
            print(f"zorro vs megatron, hybrid fp64, {case} rank {rank}: {res}")
            assert res["ranks_equal"] and res["v_heads_local"] == 2 and res["n"] == 15, (rank, case, res)
            assert res["sp"] == ("_sp" in case) and res["prefix_tree"] == case.endswith("prefix"), (rank, case)
            assert res["T"] < res["ordinary_tokens"], (rank, case, res)
            assert res["logprob"] <= TOL and res["entropy"] <= TOL and res["grad_rel"] <= TOL, (rank, case, res)
    assert results[0]["tp2_sp"]["T"] % 2 == 1  # the packed row needed a pad token under SP
