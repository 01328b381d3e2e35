"""ZoRRoDataParallelPPOActor vs verl 0.7.1's stock DataParallelPPOActor on CPU (fp32, one gloo process).

Same weights, same batch (interleaved groups, unequal prompt/response lengths, 1- and 0-token responses):
log-probs / entropies within 1e-5 (max abs, on valid response tokens), losses and grad norms within 1e-5, updated
parameters within 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from tests.integrations.verl.v07.conftest import (
    ZORRO_ON,
    fsdp2_wrap,
    make_actor,
    make_actor_config,
    make_actor_node,
    make_batch,
)
from tests.support import HANG_TIMEOUT_S

TOL = 1e-5
LOSS_KEYS = ("actor/pg_loss", "actor/kl_loss")


def _classes():
    from verl.workers.actor.dp_actor import DataParallelPPOActor

    from zorro_verl.integrations.verl.v07.actor import ZoRRoDataParallelPPOActor

    return DataParallelPPOActor, ZoRRoDataParallelPPOActor


def _max_abs(a, b, mask):
    return (a - b)[mask].abs().max().item()


def _assert_logprobs_equal(ref, got, mask, entropy=True):
    assert set(got) == set(ref)
    assert got["log_probs"].shape == ref["log_probs"].shape and got["log_probs"].dtype == torch.float32
    assert _max_abs(ref["log_probs"], got["log_probs"], mask) <= TOL
    if entropy:
        assert _max_abs(ref["entropys"], got["entropys"], mask) <= TOL


def _assert_updates_equal(stock, zorro, ms, mz):
    for k in LOSS_KEYS:
        assert abs(ms[k] - mz[k]) <= TOL, (k, ms[k], mz[k])
    gs, gz = ms["actor/grad_norm"], mz["actor/grad_norm"]
    assert len(gs) == len(gz) >= 1
    for a, b in zip(gs, gz):
        assert abs(a - b) <= TOL * max(1.0, abs(a)), (gs, gz)
    diff = max((p.detach() - q.detach()).abs().max().item()
               for p, q in zip(stock.actor_module.parameters(), zorro.actor_module.parameters()))
    moved = max((p.detach() - q.detach()).abs().max().item()
                for p, q in zip(stock.actor_module.parameters(), stock._initial))
    assert moved > 100 * TOL  # the step really changed the weights
    assert diff <= TOL


def _pair(base_model, **cfg):
    Stock, Zorro = _classes()
    stock = make_actor(Stock, base_model, make_actor_config(**cfg))
    zorro = make_actor(Zorro, base_model, make_actor_config(zorro=ZORRO_ON, **cfg))
    stock._initial = [p.detach().clone() for p in stock.actor_module.parameters()]
    return stock, zorro


@pytest.mark.parametrize("use_dynamic_bsz", [False, True], ids=["fixed", "dynamic"])
@pytest.mark.parametrize("use_remove_padding", [True, False], ids=["rmpad", "padded"])
def test_compute_log_prob_matches_stock(base_model, use_remove_padding, use_dynamic_bsz):
    stock, zorro = _pair(base_model, use_remove_padding=use_remove_padding, use_dynamic_bsz=use_dynamic_bsz)
    data = make_batch(use_dynamic_bsz=use_dynamic_bsz, micro=3, max_token_len=48)
    mask = data.batch["response_mask"].bool()
    ref = stock.compute_log_prob(data, calculate_entropy=True)
    got = zorro.compute_log_prob(data, calculate_entropy=True)
    _assert_logprobs_equal(ref, got, mask)
    assert (got["log_probs"][~data.batch["attention_mask"][:, -mask.shape[1]:].bool()] == 0).all()
    m = zorro.zorro_metrics()
    assert m["zorro/dedup_ratio"] > 1.3 and m["zorro/fallback_batches"] == 0
    ref = stock.compute_log_prob(data, calculate_entropy=False)
    got = zorro.compute_log_prob(data, calculate_entropy=False)
    _assert_logprobs_equal(ref, got, mask, entropy=False)


@pytest.mark.parametrize("use_dynamic_bsz", [False, True], ids=["fixed", "dynamic"])
@pytest.mark.parametrize("use_remove_padding", [True, False], ids=["rmpad", "padded"])
def test_update_policy_matches_stock(base_model, use_remove_padding, use_dynamic_bsz):
    """seq-mean-token-mean: verl 0.7's loss does not depend on which rows share a micro-batch, so zorro's
    group-aware regrouping of interleaved siblings must give the stock losses, grad norms and weights."""
    stock, zorro = _pair(base_model, use_remove_padding=use_remove_padding, use_dynamic_bsz=use_dynamic_bsz,
                         loss_agg_mode="seq-mean-token-mean", max_token_len=48)
    data = make_batch(allow_empty=False)
    original = {k: v.clone() for k, v in data.batch.items()}
    ms, mz = stock.update_policy(data), zorro.update_policy(data)
    _assert_updates_equal(stock, zorro, ms, mz)
    assert mz["zorro/dedup_ratio"] > 1.3 and mz["zorro/fallback_batches"] == 0
    assert all(torch.equal(v, data.batch[k]) for k, v in original.items())  # the caller's batch is untouched
    if use_dynamic_bsz:
        import verl.workers.actor.dp_actor as dp
        from verl.utils.seqlen_balancing import prepare_dynamic_batch

        assert dp.prepare_dynamic_batch is prepare_dynamic_batch  # the scoped swap was undone


def test_fsdp2_wrapped_actor_matches_stock(base_model):
    """Through FSDP2 (``fully_shard`` as verl's worker applies it): the zorro forward goes through the root module,
    so its hooks unshard the embeddings / LM head and cast the plan-carrying inputs."""
    from torch.distributed.tensor import DTensor

    Stock, Zorro = _classes()
    actors = []
    for cls, cfg in ((Stock, make_actor_config()), (Zorro, make_actor_config(zorro=ZORRO_ON))):
        m = fsdp2_wrap(base_model)
        actors.append(cls(config=cfg, actor_module=m, actor_optimizer=torch.optim.SGD(m.parameters(), lr=1.0)))
    stock, zorro = actors
    data = make_batch(allow_empty=False)
    _assert_logprobs_equal(stock.compute_log_prob(data, calculate_entropy=True),
                           zorro.compute_log_prob(data, calculate_entropy=True), data.batch["response_mask"].bool())
    ms, mz = stock.update_policy(data), zorro.update_policy(data)
    for k in LOSS_KEYS:
        assert abs(ms[k] - mz[k]) <= TOL
    for a, b in zip(ms["actor/grad_norm"], mz["actor/grad_norm"]):
        assert abs(a - b) <= TOL * max(1.0, abs(a))
    full = [p.full_tensor() if isinstance(p, DTensor) else p for p in zorro.actor_module.parameters()]
    ref = [p.full_tensor() if isinstance(p, DTensor) else p for p in stock.actor_module.parameters()]
    assert max((p - q).abs().max().item() for p, q in zip(ref, full)) <= TOL
    assert mz["zorro/dedup_ratio"] > 1.3


@pytest.mark.parametrize("mini,epochs", [(16, 1), (8, 2)], ids=["on_policy", "two_epochs"])
def test_update_policy_mini_batches_and_epochs(base_model, mini, epochs):
    """One mini-batch (verl's on-policy branch: old log-probs from the forward) and two PPO epochs."""
    stock, zorro = _pair(base_model, mini=mini, micro=4, ppo_epochs=epochs)
    data = make_batch(allow_empty=False)
    ms, mz = stock.update_policy(data), zorro.update_policy(data)
    _assert_updates_equal(stock, zorro, ms, mz)
    assert len(mz["actor/grad_norm"]) == epochs * (16 // mini)


def _siblings_adjacent_within(data, mini):
    """Oracle for the token-mean case: rows of each mini-batch reordered so siblings are adjacent (by first row)."""
    ids = data.batch["input_ids"][:, :-data.batch["responses"].shape[1]]
    keys = [tuple(r.tolist()) for r in ids * data.batch["attention_mask"][:, :ids.shape[1]]]
    order = []
    for s in range(0, len(keys), mini):
        rows = list(range(s, min(s + mini, len(keys))))
        first = {}
        for b in rows:
            first.setdefault(keys[b], b)
        order += sorted(rows, key=lambda b: (first[keys[b]], b))
    return data.select_idxs(torch.tensor(order))


@pytest.mark.parametrize("shuffle", [False, True], ids=["contiguous", "interleaved"])
def test_update_policy_token_mean(base_model, shuffle):
    """token-mean normalises each micro-batch by its own token count: zorro equals the stock actor on the same
    micro-batch membership — the same batch when siblings are already adjacent (verl's layout), else the batch
    with siblings made adjacent inside each mini-batch."""
    stock, zorro = _pair(base_model, loss_agg_mode="token-mean", mini=8, micro=4)
    data = make_batch(shuffle=shuffle)
    ref_data = _siblings_adjacent_within(data, 8) if shuffle else data
    ms, mz = stock.update_policy(ref_data), zorro.update_policy(data)
    _assert_updates_equal(stock, zorro, ms, mz)
    assert mz["zorro/split_groups"] == 0 or shuffle


def test_disabled_is_exactly_the_parent(base_model):
    Stock, Zorro = _classes()
    stock = make_actor(Stock, base_model, make_actor_config())
    off = make_actor(Zorro, base_model, make_actor_config(zorro={**ZORRO_ON, "enable": False}))
    stock._initial = [p.detach().clone() for p in stock.actor_module.parameters()]
    data = make_batch()
    a, b = stock.compute_log_prob(data, calculate_entropy=True), off.compute_log_prob(data, calculate_entropy=True)
    assert torch.equal(a["log_probs"], b["log_probs"]) and torch.equal(a["entropys"], b["entropys"])
    ms, mo = stock.update_policy(data), off.update_policy(data)
    assert ms == mo  # bit-identical, no zorro metrics
    assert all(torch.equal(p, q) for p, q in zip(stock.actor_module.parameters(), off.actor_module.parameters()))


def test_no_sharing_keeps_parent_micro_batches(base_model):
    """Every row its own prompt: the parent's micro-batches (token-mean stays equal) with zorro's forward."""
    stock, zorro = _pair(base_model, loss_agg_mode="token-mean")
    data = make_batch(batch_size=8, groups=8)
    _assert_logprobs_equal(stock.compute_log_prob(data, calculate_entropy=True),
                           zorro.compute_log_prob(data, calculate_entropy=True), data.batch["response_mask"].bool())
    ms, mz = stock.update_policy(data), zorro.update_policy(data)
    for k in LOSS_KEYS:
        assert abs(ms[k] - mz[k]) <= TOL
    assert abs(mz["zorro/dedup_ratio"] - 1.0) <= 1e-12


def test_logits_compute_mode_chunks(base_model, monkeypatch):
    Stock, Zorro = _classes()
    monkeypatch.setattr(Zorro, "logits_chunk_size", 5)
    stock = make_actor(Stock, base_model, make_actor_config())
    zorro = make_actor(Zorro, base_model, make_actor_config(zorro={**ZORRO_ON, "logits_optimization": "compute"}))
    data = make_batch()
    _assert_logprobs_equal(stock.compute_log_prob(data, calculate_entropy=True),
                           zorro.compute_log_prob(data, calculate_entropy=True), data.batch["response_mask"].bool())


@pytest.mark.parametrize("setting,extra,match", [
    ("ulysses", {"ulysses_sequence_parallel_size": 2}, "Ulysses"),
    ("fused", {"use_fused_kernels": True}, "fused kernels"),
    ("memory", {}, "logits_optimization=memory"),
])
def test_unsupported_raises(base_model, setting, extra, match):
    _, Zorro = _classes()
    zorro_cfg = {**ZORRO_ON, "logits_optimization": "memory"} if setting == "memory" else ZORRO_ON
    cfg = make_actor_config(zorro=zorro_cfg, **extra)
    with pytest.raises(ValueError, match=match):
        make_actor(Zorro, base_model, cfg)


def test_unsupported_warns_once_and_counts(base_model, caplog):
    Stock, Zorro = _classes()
    stock = make_actor(Stock, base_model, make_actor_config(use_fused_kernels=False))
    with caplog.at_level("WARNING"):
        zorro = make_actor(Zorro, base_model, make_actor_config(
            zorro={**ZORRO_ON, "logits_optimization": "memory", "on_unsupported": "warn"}))
    assert sum("unsupported setting" in r.getMessage() for r in caplog.records) == 1
    data = make_batch(micro=4)
    _assert_logprobs_equal(stock.compute_log_prob(data, calculate_entropy=True),
                           zorro.compute_log_prob(data, calculate_entropy=True), data.batch["response_mask"].bool())
    assert zorro.zorro_metrics()["zorro/fallback_batches"] == 4  # 16 rows / 4 per micro-batch, stock forward
    mz = zorro.update_policy(data)
    assert mz["zorro/fallback_batches"] == 4


def test_multimodal_micro_batch_is_refused(base_model):
    _, Zorro = _classes()
    zorro = make_actor(Zorro, base_model, make_actor_config(zorro=ZORRO_ON))
    data = make_batch(batch_size=4, groups=2)
    mb = {**data.batch, "multi_modal_inputs": [{}] * 4}
    with pytest.raises(ValueError, match="multimodal"):
        zorro._forward_micro_batch(mb, temperature=1.0)


def test_bad_key_fails_at_config_build():
    from hydra.errors import InstantiationException

    # Hydra wraps the ValueError of the dataclass (its message, naming the key, is kept).
    with pytest.raises((ValueError, InstantiationException), match="unknown key.*rollout"):
        make_actor_config(zorro={"enable": True, "rollout": 4})
    with pytest.raises((ValueError, InstantiationException), match="logits_optimization"):
        make_actor_config(zorro={"enable": True, "logits_optimization": "fast"})


# ---------------------------------------------------------------------- installation from configuration
@pytest.fixture
def routing():
    from zorro_verl.integrations.verl.v07 import actor as legacy

    legacy.install()
    yield legacy
    legacy.uninstall()


def test_routing_builds_zorro_only_when_enabled(base_model, routing):
    Stock, Zorro = _classes()
    on = make_actor(Stock, base_model, make_actor_config(zorro=ZORRO_ON))
    off = make_actor(Stock, base_model, make_actor_config(zorro={"enable": False}))
    plain = make_actor(Stock, base_model, make_actor_config())
    assert type(on) is Zorro and on.zorro_active
    assert type(off) is Stock and type(plain) is Stock
    routing.uninstall()
    assert type(make_actor(Stock, base_model, make_actor_config(zorro=ZORRO_ON))) is Stock


def test_ref_policy_from_dictconfig_node(base_model, routing):
    """verl 0.7's worker passes the ref config as an OmegaConf node (no dataclass) and no optimizer."""
    import copy

    from omegaconf import open_dict

    Stock, Zorro = _classes()
    node = make_actor_node()
    with open_dict(node):
        node.fsdp_config.zorro = dict(ZORRO_ON)
    ref = Stock(config=node, actor_module=copy.deepcopy(base_model))
    stock = Stock(config=make_actor_node(), actor_module=copy.deepcopy(base_model))
    assert type(ref) is Zorro and ref.zorro_active
    data = make_batch()
    _assert_logprobs_equal(stock.compute_log_prob(data, calculate_entropy=False),
                           ref.compute_log_prob(data, calculate_entropy=False), data.batch["response_mask"].bool(),
                           entropy=False)


def test_external_lib_installs_routing(base_model):
    """``actor_rollout_ref.model.external_lib``: verl's own import_external_libs imports the plugin module."""
    import sys

    from verl.utils.import_utils import import_external_libs

    from zorro_verl.integrations.verl.v07 import actor as legacy

    legacy.uninstall()
    sys.modules.pop("zorro_verl.integrations.verl.v07.plugin", None)
    try:
        import_external_libs("zorro_verl.integrations.verl.v07.plugin")
        assert legacy.is_routing_installed()
        Stock, Zorro = _classes()
        assert type(make_actor(Stock, base_model, make_actor_config(zorro=ZORRO_ON))) is Zorro
    finally:
        legacy.uninstall()


def test_verl_use_external_modules_env():
    """``VERL_USE_EXTERNAL_MODULES`` is read by ``import verl`` (every process, Ray workers included)."""
    import os
    import subprocess
    import sys

    code = ("import verl\n"
            "from zorro_verl.integrations.verl.v07.actor import is_routing_installed\n"
            "assert is_routing_installed()\n"
            "print('routed')\n")
    env = {**os.environ, "VERL_USE_EXTERNAL_MODULES": "zorro_verl.integrations.verl.v07.plugin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=HANG_TIMEOUT_S)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "routed" in out.stdout


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_hybrid_models_match_stock(kind):
    """Hybrid linear-attention models through the legacy actor. The stock reference runs padded rows:
    its remove-padding path packs rows into one sequence, which transformers' CPU gated delta-net cannot separate."""
    from zorro_verl.testing import tiny_hybrid_model

    model = tiny_hybrid_model(kind, dtype=torch.float32, seed=0, exact=False)
    Stock, Zorro = _classes()
    stock = make_actor(Stock, model, make_actor_config(use_remove_padding=False, loss_agg_mode="seq-mean-token-mean"))
    zorro = make_actor(Zorro, model, make_actor_config(zorro=ZORRO_ON, loss_agg_mode="seq-mean-token-mean"))
    stock._initial = [p.detach().clone() for p in stock.actor_module.parameters()]
    data = make_batch(allow_empty=False)
    _assert_logprobs_equal(stock.compute_log_prob(data, calculate_entropy=True),
                           zorro.compute_log_prob(data, calculate_entropy=True), data.batch["response_mask"].bool())
    _assert_updates_equal(stock, zorro, stock.update_policy(data), zorro.update_policy(data))
