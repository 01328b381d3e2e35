"""Zorro on megatron-core's GPTModel vs megatron's ordinary forward, fp64 on CPU (docs/design/megatron.md, testing.md).

The reference has no project code: megatron's local ``DotProductAttention`` on the right-padded rows with a causal
mask, log-probs / entropy by ``torch.log_softmax`` (tests/support/megatron_cpu.py). Compared: log-probs and entropy of
every response token (<= 1e-12 absolute) and every parameter gradient of the test loss (<= 1e-12 relative to the
parameter's largest gradient entry), on a batch with interleaved siblings, an empty and a 1-token response. TP = 1
in-process; TP = 2, TP = 2 + sequence parallelism and PP = 2 (megatron's pipeline schedule, each stage's gradients
compared) in one 2-process gloo group. Runs in ``.venv-megatron``
(scripts/test_megatron.sh); skipped where megatron-core is not installed.
"""

from __future__ import annotations

import os
import warnings

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed here (run scripts/test_megatron.sh: "
                                            ".venv-megatron)")

import torch  # noqa: E402

from tests.support import megatron_cpu as M  # noqa: E402

#: fp64 rules (docs/design/testing.md): values absolute, gradients relative to each parameter's largest entry
TOL_VALUE = 1e-12
TOL_GRAD = 1e-12
WORST: dict = {}


def _record(case: str, res: dict) -> None:
    """Check one case against the fp64 rules; ``logprob`` / ``entropy`` None: a stage without outputs (gradients
    only)."""
    WORST[case] = res
    for key in ("logprob", "entropy"):
        assert res[key] is None or res[key] <= TOL_VALUE, (case, res)
    assert res["grad_rel"] <= TOL_GRAD, (case, res)


@pytest.fixture(scope="module")
def megatron_tp1(tmp_path_factory):
    warnings.filterwarnings("ignore", message="GPTModel IS DEPRECATED")
    M.init_megatron(0, 1, str(tmp_path_factory.mktemp("rdv") / "init"))
    stock = M.build_gpt(zorro=False, parallel_output=False)
    zorro = M.build_gpt(zorro=True)
    zorro.load_state_dict(stock.state_dict())
    return stock, zorro


@pytest.mark.parametrize("backend", ["sdpa", "eager", "standard", "flash_copyfree"])  # the backends that run on the CPU
@pytest.mark.parametrize("sharing", ["prompt", "prefix"])
def test_tp1_exact(megatron_tp1, sharing, backend):
    stock, zorro = megatron_tp1
    stock.zero_grad(set_to_none=True)
    zorro.zero_grad(set_to_none=True)
    ids, am, R = M.make_batch(shared_prefix=sharing == "prefix")
    s = M.stock_outputs(stock, ids, am, R)
    lp, ent, plan = M.zorro_outputs(zorro, ids, am, R, sharing=sharing, backend=backend)
    assert plan.T < plan.ordinary_tokens  # the prompts really were deduplicated
    assert lp.dtype == torch.float64 and lp.numel() == plan.N == 15
    res = M.compare(s, (lp, ent), M.grads(stock), M.grads(zorro))
    assert res["params"] == len(list(zorro.parameters()))
    _record(f"tp1_{sharing}_{backend}", res)


@pytest.mark.parametrize("recompute", ["full", "core_attn"])
def test_activation_recomputation(megatron_tp1, recompute):
    """Megatron's recomputation re-runs the layers / the core attention in backward with the packed_seq_params it
    captured: the plan reaches the recomputed zorro attention, gradients stay exact."""
    stock, _ = megatron_tp1
    zorro = M.build_gpt(zorro=True, recompute=recompute)
    zorro.load_state_dict(stock.state_dict())
    calls = []
    for layer in zorro.decoder.layers:
        layer.self_attention.core_attention.register_forward_hook(lambda *a: calls.append(1))
    stock.zero_grad(set_to_none=True)
    ids, am, R = M.make_batch()
    s = M.stock_outputs(stock, ids, am, R)
    z = M.zorro_outputs(zorro, ids, am, R)
    assert len(calls) == 4  # 2 layers in forward, again in backward: the recomputation really ran
    _record(f"tp1_recompute_{recompute}", M.compare(s, z[:2], M.grads(stock), M.grads(zorro)))


def test_moe_exact(megatron_tp1):
    """MoE layers (top-2 of 4 experts, no load-balancing statistics): routing is token-wise, so a prompt token
    computed once is routed as each of its copies; exact in fp64 once megatron's router softmax runs in fp64 (its
    hard-wired fp32 softmax otherwise rounds the router gradients, which deduplication sums in another order: ~1e-8
    relative, the same in any reassociation of the stock forward)."""
    M.fp64_moe_routing()
    stock = M.build_gpt(zorro=False, parallel_output=False, moe=True)
    zorro = M.build_gpt(zorro=True, moe=True)
    zorro.load_state_dict(stock.state_dict())
    assert any("router" in n for n, _ in zorro.named_parameters())
    ids, am, R = M.make_batch()
    s = M.stock_outputs(stock, ids, am, R)
    z = M.zorro_outputs(zorro, ids, am, R)
    _record("tp1_moe", M.compare(s, z[:2], M.grads(stock), M.grads(zorro)))


def test_other_calls_run_the_wrapped_attention(megatron_tp1):
    """Without a zorro plan the zorro model is megatron's model: the same call gives bitwise the same logits."""
    stock, zorro = megatron_tp1
    ids = torch.randint(1, M.VOCAB, (2, 7), generator=torch.Generator().manual_seed(5))
    mask = torch.triu(torch.ones(7, 7, dtype=torch.bool), 1).view(1, 1, 7, 7)
    with torch.no_grad():
        a = stock(input_ids=ids, position_ids=None, attention_mask=mask)
        b = zorro(input_ids=ids, position_ids=None, attention_mask=mask)
    assert torch.equal(a, b)


def test_install_after_build(megatron_tp1):
    """install_zorro_megatron swaps the class of each built core attention: state dict unchanged, results exact."""
    from zorro_verl.integrations.megatron import install_zorro_megatron, zorro_attention_modules

    stock, _ = megatron_tp1
    late = M.build_gpt(zorro=False)
    late.load_state_dict(stock.state_dict())
    keys = set(late.state_dict())
    assert install_zorro_megatron(late) == 2 and install_zorro_megatron(late) == 2
    assert set(late.state_dict()) == keys and len(zorro_attention_modules(late)) == 2
    stock.zero_grad(set_to_none=True)
    ids, am, R = M.make_batch()
    s = M.stock_outputs(stock, ids, am, R)
    z = M.zorro_outputs(late, ids, am, R)
    _record("tp1_installed", M.compare(s, z[:2], M.grads(stock), M.grads(late)))


@pytest.mark.parametrize("sharing", ["prompt", "prefix"])
def test_output_layer_wrap(megatron_tp1, monkeypatch, sharing):
    """megatron-core < 0.19 has no ``output_processor``: detected, the model's ``output_layer`` is wrapped for the
    call instead (here forced on 0.19's GPTModel, whose forward then runs its own head call); exact, and the
    instance's ``forward`` is restored."""
    from zorro_verl.integrations.megatron import step

    monkeypatch.setattr(step, "has_output_processor", lambda: False)
    stock, zorro = megatron_tp1
    stock.zero_grad(set_to_none=True)
    zorro.zero_grad(set_to_none=True)
    ids, am, R = M.make_batch(shared_prefix=sharing == "prefix")
    s = M.stock_outputs(stock, ids, am, R)
    lp, ent, _ = M.zorro_outputs(zorro, ids, am, R, sharing=sharing)
    _record(f"tp1_output_layer_wrap_{sharing}", M.compare(s, (lp, ent), M.grads(stock), M.grads(zorro)))
    assert "forward" not in vars(zorro.output_layer)


def test_refusals(megatron_tp1):
    from zorro_verl.integrations.megatron import zorro_gpt_step
    from zorro_verl.packing import build_plan

    stock, zorro = megatron_tp1
    ids, am, R = M.make_batch()
    plan = build_plan(ids, am, R)
    with pytest.raises(ValueError, match="no zorro core attention"):
        zorro_gpt_step(stock, plan)
    with pytest.raises(ValueError, match="memory"):
        zorro_gpt_step(zorro, plan, logits_optimization="memory")
    with pytest.raises(ValueError, match="temperature"):
        zorro_gpt_step(zorro, plan, temperature=torch.ones(plan.B))
    with pytest.raises(ValueError, match="GPTModel"):
        zorro_gpt_step(torch.nn.Linear(2, 2), plan)
    # settings whose statistics run over the micro-batch's tokens (checked before anything runs; the MoE router's,
    # decided on the built routers, in test_moe.py)
    for changes, what in (({"fp8": "hybrid"}, "fp8"),):
        saved = {k: getattr(zorro.config, k) for k in changes}
        try:
            for k, v in changes.items():
                setattr(zorro.config, k, v)
            with pytest.raises(ValueError, match=what):
                zorro_gpt_step(zorro, plan)
        finally:
            for k, v in saved.items():
                setattr(zorro.config, k, v)
    # a mask handed to a zorro call is refused, not ignored
    from zorro_verl.integrations.megatron import ZorroPackedSeqParams

    zp = ZorroPackedSeqParams.for_plan(plan, "sdpa", plan.T)
    core = zorro.decoder.layers[0].self_attention.core_attention
    q = torch.zeros(plan.T, 1, 4, 16, dtype=torch.float64)
    kv = torch.zeros(plan.T, 1, 2, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match="attention_mask"):
        core(q, kv, kv, torch.ones(1, 1, plan.T, plan.T, dtype=torch.bool), packed_seq_params=zp)
    with pytest.raises(ValueError, match="query"):
        core(q[:-1], kv[:-1], kv[:-1], None, packed_seq_params=zp)
    # context parallelism: a CP shard handed to a model without CP (and the reverse) is refused; MLA under CP too
    from zorro_verl.packing.context_parallel import cp_shard

    shard = cp_shard(plan, 2, 0)
    zp_cp = ZorroPackedSeqParams.for_plan(plan, "sdpa", shard.local_len, cp=shard)
    L = shard.local_len
    with pytest.raises(ValueError, match="the zorro params a CP shard of"):
        core(q[:L], kv[:L], kv[:L], None, packed_seq_params=zp_cp)
    zorro.config.context_parallel_size = 2
    try:
        with pytest.raises(ValueError, match="the zorro params a CP shard of"):
            core(q, kv, kv, None, packed_seq_params=zp)
        zorro.config.multi_latent_attention = True
        with pytest.raises(ValueError, match="expected 1 with zorro on multi_latent_attention"):
            zorro_gpt_step(zorro, plan)
    finally:
        zorro.config.context_parallel_size = 1
        zorro.config.multi_latent_attention = False


def test_two_ranks_tp_sp_pp(tmp_path):
    """TP = 2 and TP = 2 + sequence parallelism (the log-probs from the vocabulary slices without gathering them),
    the vocabulary-parallel log-prob function alone, then PP = 2 through megatron's pipeline schedule: all in one
    2-process gloo group."""
    from tests.support.multi_rank import run_ranks

    results = run_ranks("tests.support.megatron_ranks", 2, [], tmp_path, timeout_s=int(os.environ.get(
        "ZORRO_MEGATRON_RANK_TIMEOUT", "600")))
    for rank, per_case in enumerate(results):
        vp = per_case.pop("vocab_parallel")
        assert vp["cases"] == 12
        WORST[f"vocab_parallel_rank{rank}"] = {"logprob": vp["logprob"], "entropy": vp["entropy"],
                                               "grad_rel": vp["grad"]}
        assert vp["logprob"] <= TOL_VALUE and vp["entropy"] <= TOL_VALUE and vp["grad"] <= TOL_GRAD, (rank, vp)
        pp = per_case.pop("pp2")
        assert pp["stage"] == rank and pp["last"] == (rank == 1) and pp["params"] == (7 if rank == 0 else 8)
        assert pp.pop("step_refused")
        if pp["last"]:
            assert pp["n"] == 30  # two micro-batches of 15 response tokens
        else:  # the first stage returns hidden states: only its gradients are compared
            pp.update(logprob=None, entropy=None)
        _record(f"pp2_stage{rank}", pp)
        assert set(per_case) == {"tp2", "tp2_sp", "tp2_sp_prefix", "tp2_sp_wrap"}
        for case, res in per_case.items():
            assert res["ranks_equal"], (rank, case)
            assert res["sp"] == case.startswith("tp2_sp")
            _record(f"{case}_rank{rank}", res)
    assert results[0]["tp2_sp"]["T"] % 2 == 1  # the packed row needed a pad token under SP
