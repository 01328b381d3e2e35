"""Zorro on megatron-core's multi-latent attention (``MLASelfAttention``, DeepSeek-V3 / Kimi-K2 style) vs megatron's
ordinary forward, fp64 on CPU (docs/design/megatron.md, testing.md).

The model (``build_gpt(mla=True)``, tests/support/megatron_cpu.py): compressed queries (``q_lora_rank``) and keys /
values (``kv_lora_rank``), q / k heads of ``qk_head_dim + qk_pos_emb_head_dim = 16 + 8`` and v heads of 12, the
decoupled RoPE part rotated by each layer's own ``rotary_pos_emb`` (plain RoPE or YaRN, megatron's unfused path).
The reference has no project code: megatron's local ``DotProductAttention`` (constructor adapted to MLA's k / v
channel arguments) on the right-padded rows with a causal mask, log-probs / entropy by ``torch.log_softmax``.
Compared as test_gpt_step.py: log-probs and entropy <= 1e-12 absolute, every parameter gradient <= 1e-12 relative.
TP = 1 in-process; TP = 2 and TP = 2 + sequence parallelism in a 2-process gloo group
(tests/support/megatron_mla_ranks.py).
"""

from __future__ import annotations

import os
import warnings

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed here (run scripts/test_megatron.sh: "
                                            ".venv-megatron)")

import torch  # noqa: E402

from tests.support import megatron_cpu as M  # noqa: E402

TOL_VALUE = 1e-12
TOL_GRAD = 1e-12
WORST: dict = {}


def _record(case: str, res: dict) -> None:
    WORST[case] = res
    assert res["logprob"] <= TOL_VALUE and res["entropy"] <= TOL_VALUE, (case, res)
    assert res["grad_rel"] <= TOL_GRAD, (case, res)


@pytest.fixture(scope="module")
def megatron_tp1(tmp_path_factory):
    warnings.filterwarnings("ignore", message="GPTModel IS DEPRECATED")
    M.init_megatron(0, 1, str(tmp_path_factory.mktemp("rdv") / "init"))


def _pair(rope_type="rope", q_lora_rank=24, qk_layernorm=True, **kw):
    stock = M.build_gpt(zorro=False, parallel_output=False, mla=True, rope_type=rope_type, q_lora_rank=q_lora_rank,
                        qk_layernorm=qk_layernorm)
    zorro = M.build_gpt(zorro=True, mla=True, rope_type=rope_type, q_lora_rank=q_lora_rank,
                        qk_layernorm=qk_layernorm, **kw)
    zorro.load_state_dict(stock.state_dict())
    return stock, zorro


def test_model_is_mla(megatron_tp1):
    """The model really is MLA: q / k head dim != v head dim, compressed q and kv, a RoPE table per layer and none
    on the model."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    _, zorro = _pair()
    att = zorro.decoder.layers[0].self_attention
    assert isinstance(att, MLASelfAttention) and not hasattr(zorro, "rotary_pos_emb")
    cfg = zorro.config
    assert cfg.qk_head_dim + cfg.qk_pos_emb_head_dim != cfg.v_head_dim
    assert hasattr(att, "linear_q_down_proj") and hasattr(att, "linear_kv_down_proj")


@pytest.mark.parametrize("backend", ["sdpa", "eager", "standard", "flash_copyfree"])
@pytest.mark.parametrize("sharing", ["prompt", "prefix"])
@pytest.mark.parametrize("rope_type", ["rope", "yarn"])
def test_tp1_exact(megatron_tp1, rope_type, sharing, backend):
    stock, zorro = _pair(rope_type)
    ids, am, R = M.make_batch(shared_prefix=sharing == "prefix")
    s = M.stock_outputs(stock, ids, am, R)
    lp, ent, plan = M.zorro_outputs(zorro, ids, am, R, sharing=sharing, backend=backend)
    assert plan.T < plan.ordinary_tokens and lp.dtype == torch.float64 and lp.numel() == plan.N == 15
    res = M.compare(s, (lp, ent), M.grads(stock), M.grads(zorro))
    assert res["params"] == len(list(zorro.parameters()))
    _record(f"mla_tp1_{rope_type}_{sharing}_{backend}", res)


def test_tp1_uncompressed_queries(megatron_tp1):
    """``q_lora_rank=None`` (queries projected straight from the hidden states, DeepSeek-V2-Lite style), no norms on
    the compressed parts."""
    stock, zorro = _pair("yarn", q_lora_rank=None, qk_layernorm=False)
    ids, am, R = M.make_batch()
    s = M.stock_outputs(stock, ids, am, R)
    z = M.zorro_outputs(zorro, ids, am, R)
    _record("mla_tp1_no_q_lora", M.compare(s, z[:2], M.grads(stock), M.grads(zorro)))


@pytest.mark.parametrize("recompute", ["full", "core_attn"])
def test_activation_recomputation(megatron_tp1, recompute):
    stock, zorro = _pair(recompute=recompute)
    calls = []
    for layer in zorro.decoder.layers:
        layer.self_attention.core_attention.register_forward_hook(lambda *a: calls.append(1))
    ids, am, R = M.make_batch()
    s = M.stock_outputs(stock, ids, am, R)
    z = M.zorro_outputs(zorro, ids, am, R)
    assert len(calls) == 4  # 2 layers in forward, again in backward
    _record(f"mla_tp1_recompute_{recompute}", M.compare(s, z[:2], M.grads(stock), M.grads(zorro)))


def test_install_after_build(megatron_tp1):
    """install_zorro_megatron finds MLA layers and takes MLA's own softmax scale (mscale^2 / sqrt(24) with YaRN)."""
    from zorro_verl.integrations.megatron import install_zorro_megatron

    stock, _ = _pair("yarn")
    late = M.build_gpt(zorro=False, mla=True, rope_type="yarn")
    late.load_state_dict(stock.state_dict())
    assert install_zorro_megatron(late) == 2
    att = late.decoder.layers[0].self_attention
    assert att.core_attention._zorro_scale == att.softmax_scale != 1 / 24 ** 0.5
    ids, am, R = M.make_batch()
    s = M.stock_outputs(stock, ids, am, R)
    z = M.zorro_outputs(late, ids, am, R)
    _record("mla_tp1_installed_yarn", M.compare(s, z[:2], M.grads(stock), M.grads(late)))


def test_positions_are_checked(megatron_tp1, monkeypatch):
    """The comparison sees RoPE: rotating each packed token by its index in the packed row instead of its position
    in its ordinary row is far off (so 1e-12 above means the positions are right), and YaRN's table is not RoPE's."""
    from zorro_verl.integrations.megatron import ZorroPackedSeqParams

    stock, zorro = _pair("yarn")
    ids, am, R = M.make_batch()
    s = M.stock_outputs(stock, ids, am, R)
    real = ZorroPackedSeqParams.for_plan.__func__

    def by_index(cls, plan, backend, padded_len):
        zp = real(cls, plan, backend, padded_len)
        zp.position_ids = torch.arange(padded_len)  # the index in the packed row, and a table that long
        zp.max_seqlen_q = zp.max_seqlen_kv = padded_len
        return zp

    monkeypatch.setattr(ZorroPackedSeqParams, "for_plan", classmethod(by_index))
    wrong = M.zorro_outputs(zorro, ids, am, R)
    assert (wrong[0] - s[0]).abs().max().item() > 1e-7
    rope_stock, _ = _pair("rope")
    assert (M.stock_outputs(rope_stock, ids, am, R)[0] - s[0]).abs().max().item() > 1e-7


def test_rope_restored_and_refusals(megatron_tp1):
    """Each layer's RoPE table is its own again after a step; the MLA settings zorro has not checked are refused by
    name; an MLA layer without zorro's RoPE positions is refused (not run on index positions)."""
    from zorro_verl.integrations.megatron import zorro_gpt_step
    from zorro_verl.packing import build_plan

    _, zorro = _pair("yarn")
    ids, am, R = M.make_batch()
    plan = build_plan(ids, am, R)
    zorro_gpt_step(zorro, plan)
    assert all("forward" not in vars(layer.self_attention.rotary_pos_emb) for layer in zorro.decoder.layers)
    for name, value in (("apply_rope_fusion", True), ("rotary_interleaved", True), ("cache_mla_latents", True),
                        ("mla_down_proj_fusion", True)):
        saved = getattr(zorro.config, name)
        setattr(zorro.config, name, value)
        try:
            with pytest.raises(ValueError, match=name):
                zorro_gpt_step(zorro, plan)
        finally:
            setattr(zorro.config, name, saved)
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    zorro.decoder.layers[1].self_attention.__class__ = MLASelfAttention
    with pytest.raises(ValueError, match="without zorro's RoPE positions"):
        zorro_gpt_step(zorro, plan)
    assert all("forward" not in vars(layer.self_attention.rotary_pos_emb) for layer in zorro.decoder.layers)


def test_two_ranks_tp_sp(tmp_path):
    """TP = 2 (each rank 2 of the 4 heads) and TP = 2 + sequence parallelism (the row padded to even length), RoPE
    and YaRN, prompt and prefix plans, with and without compressed queries."""
    from tests.support.multi_rank import run_ranks

    results = run_ranks("tests.support.megatron_mla_ranks", 2, [], tmp_path, timeout_s=int(os.environ.get(
        "ZORRO_MEGATRON_RANK_TIMEOUT", "600")))
    for rank, per_case in enumerate(results):
        assert set(per_case) == {"tp2_rope", "tp2_sp_yarn", "tp2_sp_yarn_prefix", "tp2_sp_rope_no_q_lora"}
        for case, res in per_case.items():
            assert res["ranks_equal"] and res["heads_local"] == 2 and res["n"] == 15, (rank, case)
            assert res["sp"] == ("_sp_" in case)
            _record(f"mla_{case}_rank{rank}", res)
    assert results[0]["tp2_sp_yarn"]["T"] % 2 == 1  # the packed row needed a pad token under SP
