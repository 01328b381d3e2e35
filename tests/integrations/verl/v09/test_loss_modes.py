"""Every loss setting of verl 0.9.1's ``ppo_loss`` through the zorro engine vs the stock engine (CPU, FSDP2, fp32).

The batch is shuffled (siblings interleaved, uneven response lengths) and the zorro engine regroups its rows into
other micro-batches than the stock engine (checked), so a loss that depends on micro-batch membership would
differ. KL loss and an entropy coefficient are on. Two layouts: ``padded`` (``RayPPOTrainer``: prompts, responses
and response fields padded ``[B, R]``) and ``nested`` (the V1 trainer: all of them jagged). Modes zorro runs
exactly compare loss, grad norm and every gradient; modes it cannot (``zorro_verl.integrations.verl.v09.losses``)
raise with ``on_unsupported=raise`` and with ``warn`` run the stock forward, counted in ``zorro/fallback_batches``.
The policy losses of ``EQUAL`` are the allow-list ``VERIFIED_POLICY_LOSSES``; any other registered loss is refused.

Tolerances (docs/design/testing.md): loss and grad norm relative <= 1e-5, gradients relative to the largest <= 1e-5.
"""

import pytest

pytestmark = pytest.mark.usefixtures("verl_cpu")  # skips without verl 0.9

RTOL = 1e-5
ALL_AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
LOSS_TERMS = dict(use_kl_loss=True, kl_loss_type="low_var_kl", kl_loss_coef=0.1, entropy_coeff=0.01)

NORM = {"loss_agg_mode": "seq-mean-token-sum-norm"}
# (layout, id, ppo_loss_fn kwargs) of the settings zorro runs exactly
EQUAL = [(layout, mode, {"loss_agg_mode": mode}) for layout in ("padded", "nested") for mode in ALL_AGG_MODES
         if (layout, mode) != ("nested", "seq-mean-token-sum-norm")] + [
    ("nested", "seq-mean-token-sum-norm+loss_scale_factor", {**NORM, "loss_scale_factor": 6}),
] + [("nested", f"policy:{m}", {"loss_agg_mode": "token-mean", "policy_loss": {"loss_mode": m}})
     for m in ("vanilla", "gspo", "sapo", "gpg", "cispo", "dppo_tv", "dppo_kl")] + [
    ("nested", "policy:dro", {"loss_agg_mode": "token-mean", "policy_loss": {"loss_mode": "dro", "dro_beta": 0.5}}),
] + [  # bypass_mode (old log-probs = rollout log-probs): token IS weights, per-token rejection; PPO-clip / REINFORCE
    ("nested", f"policy:bypass_mode-{kind}", {"loss_agg_mode": "token-mean", "policy_loss": {
        "loss_mode": "bypass_mode", "rollout_correction": {
            "loss_type": kind, "rollout_is": "token", "rollout_is_threshold": 1.2, "rollout_is_batch_normalize": False,
            "rollout_rs": "token_k1", "rollout_rs_threshold": "0.5_1.5"}}}) for kind in ("ppo_clip", "reinforce")
]
# (layout, id, ppo_loss_fn kwargs, text the refusal names) of the settings zorro refuses
REFUSED = [
    ("nested", "seq-mean-token-sum-norm", NORM, "loss_scale_factor"),
] + [(layout, f"policy:{m}", {"policy_loss": {"loss_mode": m, **extra}}, m) for layout in ("padded", "nested")
     for m, extra in (("clip_cov", {}), ("kl_cov", {"kl_cov_ratio": 0.2}), ("geo_mean", {}))]


def _nested_layout(td):
    """The V1 trainer's layout of a batch: prompts, responses and every response field jagged (valid tokens)."""
    import torch

    am, P = td["attention_mask"], td["prompts"].shape[1]
    out = td.clone()
    valid = {"prompts": am[:, :P].bool(), "responses": am[:, P:].bool()}
    for key in ("response_mask", "old_log_probs", "advantages", "ref_log_prob"):
        valid[key] = am[:, P:].bool()
    for key, mask in valid.items():
        rows = [td[key][i][mask[i]] for i in range(mask.shape[0])]
        del out[key]
        out[key] = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    del out["max_response_len"]  # the V1 trainer sets none: verl pads each micro-batch to its longest response
    return out


@pytest.fixture(scope="module")
def setup(verl_cpu, tiny_ckpt):
    """Stock, zorro (raise) and zorro (warn) engines with lr=0 (train steps leave the weights unchanged, so the
    engines are shared by every case), and a shuffled batch that zorro regroups across micro-batches."""
    from tests.support.verl_engines import build_engine, make_engine_batch

    kw = dict(micro_batch_size=4, lr=0.0)
    engines = (build_engine(tiny_ckpt, zorro=False, **kw), build_engine(tiny_ckpt, zorro=True, **kw),
               build_engine(tiny_ckpt, zorro=True, zorro_settings={"on_unsupported": "warn"}, **kw))
    td = make_engine_batch(batch_size=12, num_prompts=3, prompt_len=7, response_len=6, seed=11, shuffle=True,
                           temperature=0.9, calculate_entropy=True, micro_batch_size=4)
    # groups of 3 under micro-batches of 4: zorro's micro-batches also differ in size from the stock ones
    td3 = make_engine_batch(batch_size=12, num_prompts=4, prompt_len=7, response_len=6, seed=12, shuffle=True,
                            temperature=0.9, calculate_entropy=True, micro_batch_size=4)
    return engines, {"padded": td, "nested": _nested_layout(td), "nested3": _nested_layout(td3)}


def _train(engine, td, loss_fn):
    from tests.support.verl_engines import engine_grads

    with engine.train_mode(zero_grad_on_exit=False):  # keep the grads for the comparison
        out = engine.train_batch(td.clone(), loss_function=loss_fn)
    return out, engine_grads(engine)


def _assert_equal(ref, got):
    from zorro_verl.testing import grad_rel_error

    (a, ga), (b, gb) = ref, got
    loss_a, loss_b = sum(a["loss"]), sum(b["loss"])
    gn_a, gn_b = float(a["metrics"]["grad_norm"]), float(b["metrics"]["grad_norm"])
    assert abs(loss_a) > 1e-4 and gn_a > 1e-4  # a real comparison
    errs = (abs(loss_a - loss_b) / abs(loss_a), abs(gn_a - gn_b) / gn_a, grad_rel_error(ga, gb))
    assert max(errs) <= RTOL, f"loss / grad norm / grad relative errors {errs}"
    return errs


def test_zorro_regroups_this_batch(setup):
    """The premise of the comparisons: zorro's micro-batches are not the stock engine's contiguous chunks of 4."""
    from tests.support.verl_engines import ppo_loss_fn

    (stock, zorro, _), tds = setup
    _train(zorro, tds["padded"], ppo_loss_fn(**LOSS_TERMS))
    batches = [sorted(mb) for mb in zorro.zorro_last_micro_batches.batches]
    stock_chunks = [list(range(i, i + 4)) for i in range(0, 12, 4)]
    assert not any(mb in stock_chunks for mb in batches), batches


@pytest.mark.parametrize("layout, kw", [(lay, kw) for lay, _, kw in EQUAL], ids=[f"{lay}-{n}" for lay, n, _ in EQUAL])
def test_equal_loss_modes_match_stock(setup, layout, kw):
    from tests.support.verl_engines import ppo_loss_fn

    (stock, zorro, _), tds = setup
    td = tds[layout]
    got = _train(zorro, td, ppo_loss_fn(**LOSS_TERMS, **kw))
    assert got[0]["metrics"]["zorro/fallback_batches"] == [0.0]
    _assert_equal(_train(stock, td, ppo_loss_fn(**LOSS_TERMS, **kw)), got)


@pytest.mark.parametrize("layout, kw, match", [(lay, kw, m) for lay, _, kw, m in REFUSED],
                         ids=[f"{lay}-{n}" for lay, n, _, _ in REFUSED])
def test_refused_loss_modes_raise_or_fall_back(setup, layout, kw, match):
    from tests.support.verl_engines import ppo_loss_fn

    (stock, zorro, warn), tds = setup
    td = tds[layout]
    with pytest.raises(ValueError, match=match):
        _train(zorro, td, ppo_loss_fn(**LOSS_TERMS, **kw))
    got = _train(warn, td, ppo_loss_fn(**LOSS_TERMS, **kw))
    assert got[0]["metrics"]["zorro/fallback_batches"] == [1.0]
    if "clip_cov" not in match:  # clip_cov draws its clipped tokens at random (torch.randperm)
        _assert_equal(_train(stock, td, ppo_loss_fn(**LOSS_TERMS, **kw)), got)


DEPENDENT = [(lay, name, kw) for lay, name, kw, _ in REFUSED if lay == "nested" and name != "policy:clip_cov"]


@pytest.mark.parametrize("layout, kw", [(lay, kw) for lay, _, kw in DEPENDENT],
                         ids=[f"{lay}-{n}" for lay, n, _ in DEPENDENT])
def test_refused_modes_do_depend_on_regrouping(setup, layout, kw, monkeypatch):
    """Why they are refused: with the check switched off, zorro's regrouping changes these losses (clip_cov draws
    at random, so it is left out here)."""
    from tests.support.verl_engines import ppo_loss_fn
    from zorro_verl.integrations.verl.v09 import batching as engine_module

    (stock, zorro, _), tds = setup
    td = tds["nested3"]
    monkeypatch.setattr(engine_module, "loss_unsupported", lambda *args: None)
    (a, _), (b, _) = _train(stock, td, ppo_loss_fn(**LOSS_TERMS, **kw)), _train(zorro, td,
                                                                                  ppo_loss_fn(**LOSS_TERMS, **kw))
    loss_a, loss_b = sum(a["loss"]), sum(b["loss"])
    assert abs(loss_a - loss_b) > 100 * RTOL * abs(loss_a), (loss_a, loss_b)


def test_forward_only_passes_without_a_loss_are_not_refused(setup):
    """Old-log-prob / ref passes hand the engine no loss function: the loss settings do not apply."""
    from tests.support.verl_engines import ppo_loss_fn

    (_, zorro, _), tds = setup
    with zorro.eval_mode():
        out = zorro.infer_batch(tds["nested"].clone(), loss_function=None)
    assert out["metrics"]["zorro/fallback_batches"] == [0.0]
    assert ppo_loss_fn("seq-mean-token-sum-norm") is not None


def test_reasons_name_the_setting_and_the_fix():
    from functools import partial

    from tests.support.verl_engines import ppo_loss_fn
    from zorro_verl.integrations.verl.v09.losses import loss_unsupported

    assert "set actor_rollout_ref.actor.loss_scale_factor" in loss_unsupported(ppo_loss_fn("seq-mean-token-sum-norm"))
    assert "vanilla" in loss_unsupported(ppo_loss_fn(policy_loss={"loss_mode": "kl_cov"}))
    bypass = {"loss_mode": "bypass_mode", "rollout_correction": {"rollout_is": "token",
                                                                 "rollout_is_batch_normalize": True}}
    assert "rollout_is_batch_normalize=false" in loss_unsupported(ppo_loss_fn(policy_loss=bypass))
    bypass["rollout_correction"]["rollout_is_batch_normalize"] = False
    assert loss_unsupported(ppo_loss_fn(policy_loss=bypass)) is None
    # verl's worker binds the config by keyword; a positional binding and nested partials are read too
    cfg = ppo_loss_fn("seq-mean-token-sum-norm").keywords["config"]
    assert loss_unsupported(partial(partial(lambda config, **kw: None, cfg))) is not None
    assert loss_unsupported(lambda **kw: None) is None
    # distillation with a policy-gradient term: its own policy loss mode is checked
    distill = {"distillation_loss": {"use_policy_gradient": True, "policy_loss_mode": "clip_cov"}}
    assert "clip_cov" in loss_unsupported(partial(lambda **kw: None, config=ppo_loss_fn().keywords["config"],
                                                  distillation_config=distill))


def test_verified_policy_losses_are_the_measured_ones():
    """The allow-list is exactly the policy losses EQUAL measures against the stock engine."""
    from zorro_verl.integrations.verl.v09.losses import VERIFIED_POLICY_LOSSES

    measured = {kw["policy_loss"]["loss_mode"] for _, _, kw in EQUAL if "policy_loss" in kw}
    assert measured == set(VERIFIED_POLICY_LOSSES)


def test_unverified_registered_policy_loss_is_refused(setup, monkeypatch):
    """A policy loss registered through verl's registry that zorro has not verified, or a verified name re-registered
    with another function, is refused with the verified list and the stock-engine switch (warn: the stock forward,
    counted), never run unchecked."""
    from verl.trainer.ppo import core_algos

    from tests.support.verl_engines import ppo_loss_fn

    (stock, zorro, warn), tds = setup
    td = tds["nested"]
    vanilla = core_algos.POLICY_LOSS_REGISTRY["vanilla"]

    def custom_loss(**kw):  # numerically vanilla, but zorro cannot know that
        return vanilla(**kw)

    monkeypatch.setitem(core_algos.POLICY_LOSS_REGISTRY, "zorro_test_custom", custom_loss)
    assert core_algos.get_policy_loss_fn("zorro_test_custom") is custom_loss
    kw = dict(**LOSS_TERMS, policy_loss={"loss_mode": "zorro_test_custom"})
    with pytest.raises(ValueError, match="'zorro_test_custom' is not a policy loss zorro has verified") as info:
        _train(zorro, td, ppo_loss_fn(**kw))
    assert "verified: vanilla, gspo" in str(info.value) and "zorro.enable=false" in str(info.value)
    got = _train(warn, td, ppo_loss_fn(**kw))
    assert got[0]["metrics"]["zorro/fallback_batches"] == [1.0]
    _assert_equal(_train(stock, td, ppo_loss_fn(**kw)), got)
    # a verified name whose registered function is not verl's own
    monkeypatch.setitem(core_algos.POLICY_LOSS_REGISTRY, "vanilla", custom_loss)
    with pytest.raises(ValueError, match="'vanilla' is registered in verl's policy-loss registry as .*custom_loss"):
        _train(zorro, td, ppo_loss_fn(**LOSS_TERMS))
