"""On-policy distillation's student update through the zorro FSDP engine vs verl 0.9.1's stock engine (CPU, fp32,
1-rank gloo), on recorded batches.

verl's distillation trainer is its PPO trainer with ``distillation.enabled``: the teacher scores each rollout in an
inference server (``prompt_logprobs``; zorro has no seam there, see ``roles.py``) and the batch reaches the actor
engine with the teacher's top-k ids / log-probs (or, for the KL estimators, its log-prob of each token) as jagged
per-token tensors. The batches here are recorded the same way: a second tiny model (the teacher) scores every row of
a GRPO-shaped batch (ordinary forward, top-k of its log-softmax at each position), and verl's
``left_right_2_no_padding`` turns them into the engine's layout. Each case runs two steps: a forward-only pass with
verl's ``distillation_ppo_loss`` (every model output compared at the positions verl reads), then ``train_batch``
(loss, grad norm and every gradient after one SGD step), on the weights of the previous step. Tolerances
(docs/design/testing.md): outputs max abs <= 1e-5, loss / grad norm / gradients relative <= 1e-5.
"""

import pytest
import torch

pytestmark = pytest.mark.usefixtures("verl_cpu")  # skips without verl 0.9

ATOL = 1e-5
RTOL = 1e-5
TOPK = 4
OUTPUTS = ("log_probs", "entropy", "distillation_losses", "student_mass", "teacher_mass", "overlap_count",
           "overlap_token_advantage")


@pytest.fixture(scope="module")
def teacher():
    """The recording teacher: another tiny Qwen3 (different weights from the student checkpoint)."""
    from zorro_verl.testing import tiny_model

    return tiny_model("qwen3", dtype=torch.float32, seed=1).eval()


def _batch(teacher, *, seed, topk, **kw):
    """A jagged verl batch with the teacher's per-position tensors: ``teacher_ids`` / ``teacher_logprobs``
    ``[B, S, K]`` (top-k of the teacher's distribution predicting the next token; K = 1 and the next token's own
    log-prob for the estimator losses), zeros / id 0 on pads, as verl's agent loop pads them."""
    from tests.support.verl_engines import make_engine_batch
    from zorro_verl.testing import create_dummy_batch

    b = create_dummy_batch(batch_size=12, num_unique_prompts=3, prompt_len=7, response_len=6, device="cpu",
                           include_training_fields=True, add_padding=True, vocab_size=128, seed=seed, shuffle=True)
    am = b["attention_mask"]
    with torch.no_grad():
        logp = torch.log_softmax(teacher(input_ids=b["input_ids"], attention_mask=am,
                                         position_ids=b["position_ids"]).logits.float(), -1)  # [B, S, V]
    if topk:
        vals, ids = logp.topk(TOPK, dim=-1)
    else:
        ids = torch.cat([b["input_ids"][:, 1:], b["input_ids"][:, -1:]], 1)[..., None]
        vals = logp.gather(-1, ids)
    b["teacher_ids"] = ids * am[..., None]
    b["teacher_logprobs"] = vals * am[..., None]
    return make_engine_batch(base=b, **kw)


def _loss_fn(loss_mode, *, use_task_rewards, use_policy_gradient, loss_agg_mode="token-mean"):
    """verl's ``distillation_ppo_loss`` bound as verl's worker binds it."""
    from functools import partial

    from verl.trainer.distillation import distillation_ppo_loss
    from verl.workers.config import DistillationConfig, DistillationLossConfig

    from tests.support.verl_engines import ppo_loss_fn

    actor_cfg = ppo_loss_fn(loss_agg_mode).keywords["config"]
    dcfg = DistillationConfig(distillation_loss=DistillationLossConfig(
        loss_mode=loss_mode, topk=TOPK, use_task_rewards=use_task_rewards, use_policy_gradient=use_policy_gradient,
        log_prob_min_clamp=-10.0))
    return partial(distillation_ppo_loss, config=actor_cfg, distillation_config=dcfg)


def _flags(td, loss_fn):
    """The trainer's ``_update_actor`` flags (verl's rule) on a copy of ``td``."""
    from verl.utils import tensordict_utils as tu

    lc = loss_fn.keywords["distillation_config"].distillation_loss
    topk = lc.loss_settings.use_topk
    td = td.clone()
    tu.assign_non_tensor(td, distillation_use_topk=topk,
                         distillation_only=topk and not lc.use_task_rewards and not lc.use_policy_gradient)
    return td


def _run(engine, batches, loss_fn):
    from tests.support.verl_engines import engine_grads

    out = []
    for td in batches:
        with engine.eval_mode():
            inf = engine.infer_batch(_flags(td, loss_fn), loss_function=loss_fn)
        with engine.train_mode(zero_grad_on_exit=False):
            tr = engine.train_batch(_flags(td, loss_fn), loss_function=loss_fn)
        out.append({"inf": inf, "tr": tr, "grads": engine_grads(engine)})
    return out


def _errors(ref, got, batches):
    from tests.support.verl_engines import response_values
    from zorro_verl.testing import grad_rel_error

    errs = []
    for a, b, td in zip(ref, got, batches):
        mask = td["response_mask"].bool()
        e = {"outputs": {}}
        for key in OUTPUTS:
            assert (key in a["inf"]["model_output"]) == (key in b["inf"]["model_output"]), key
            if key in a["inf"]["model_output"]:
                va, vb = (response_values(x["inf"]["model_output"][key], td).double() for x in (a, b))
                e["outputs"][key] = ((va - vb)[mask].abs().max().item(), va[mask].abs().max().item())
        e["loss"] = (sum(a["tr"]["loss"]), sum(b["tr"]["loss"]))
        e["grad_norm"] = (float(a["tr"]["metrics"]["grad_norm"]), float(b["tr"]["metrics"]["grad_norm"]))
        e["grad_rel"] = grad_rel_error(a["grads"], b["grads"])
        e["fallback"] = [m.get("zorro/fallback_batches", [0.0])[0] for m in (b["inf"]["metrics"], b["tr"]["metrics"])]
        e["dedup"] = b["tr"]["metrics"]["zorro/dedup_ratio"][0]
        errs.append(e)
    return errs


def _assert_match(errs, expect_outputs):
    for k, e in enumerate(errs):
        assert set(e["outputs"]) == set(expect_outputs), (k, e)
        for key, (err, scale) in e["outputs"].items():
            # scale: the output is not trivially zero (overlap_token_advantage is O(1e-4) for these tiny models)
            assert scale > 1e-5 and err <= ATOL, (k, key, e)
        la, lb = e["loss"]
        assert abs(la) > 1e-4 and abs(la - lb) <= RTOL * abs(la), (k, e)
        ga, gb = e["grad_norm"]
        assert ga > 1e-5 and abs(ga - gb) <= RTOL * ga, (k, e)
        assert e["grad_rel"] <= RTOL, (k, e)
        assert e["fallback"] == [0.0, 0.0] and e["dedup"] > 1.0, (k, e)


def _compare(ckpt, teacher, loss_fn, *, topk, strategy="fsdp2", dynamic=False, temperature=1.0, settings=None):
    from tests.support.verl_engines import STEPS_OPTIM, build_engine

    batches = [_batch(teacher, seed=s, topk=topk, use_dynamic_bsz=dynamic, micro_batch_size=3, max_token_len=40,
                      temperature=temperature) for s in (3, 4)]
    runs = {z: _run(build_engine(ckpt, zorro=z, strategy=strategy, use_dynamic_bsz=dynamic, micro_batch_size=3,
                                 max_token_len=40, optim_overrides=STEPS_OPTIM, zorro_settings=settings),
                    batches, loss_fn)
            for z in (False, True)}
    return _errors(runs[False], runs[True], batches)


def test_topk_distillation_only_matches_stock(tiny_ckpt, teacher, strategy):
    """forward_kl_topk alone (``distillation_only``: no log-probs, verl's supervised top-k KL), fixed micro-batches,
    FSDP2 and FSDP1."""
    loss_fn = _loss_fn("forward_kl_topk", use_task_rewards=False, use_policy_gradient=False)
    errs = _compare(tiny_ckpt, teacher, loss_fn, topk=True, strategy=strategy)
    _assert_match(errs, ("entropy", "distillation_losses", "student_mass", "teacher_mass", "overlap_count",
                         "overlap_token_advantage"))
    print("topk distillation_only", strategy, errs)


def test_topk_with_task_rewards_and_policy_gradient_matches_stock(tiny_ckpt, teacher):
    """forward_kl_topk as a policy-gradient reward beside the PPO loss on task rewards, a non-unit temperature,
    dynamic micro-batches and prefix sharing."""
    loss_fn = _loss_fn("forward_kl_topk", use_task_rewards=True, use_policy_gradient=True)
    errs = _compare(tiny_ckpt, teacher, loss_fn, topk=True, dynamic=True, temperature=0.7,
                    settings={"sharing": "prefix", "min_shared_len": 1})
    _assert_match(errs, OUTPUTS)
    print("topk task+pg", errs)


def test_k3_estimator_matches_stock(tiny_ckpt, teacher):
    """The default estimator loss (k3 on the teacher's log-prob of each token; the student's log-probs only), added
    to the PPO loss."""
    loss_fn = _loss_fn("k3", use_task_rewards=True, use_policy_gradient=False)
    errs = _compare(tiny_ckpt, teacher, loss_fn, topk=False)
    _assert_match(errs, ("log_probs", "entropy"))
    print("k3", errs)


def test_topk_refusals(tiny_ckpt, teacher):
    """Top-k distillation with a setting zorro's distillation path does not run raises by name
    (``logits_optimization=memory``: the loss needs the student's logits)."""
    from tests.support.verl_engines import build_engine

    loss_fn = _loss_fn("forward_kl_topk", use_task_rewards=False, use_policy_gradient=False)
    td = _flags(_batch(teacher, seed=3, topk=True, micro_batch_size=3), loss_fn)
    eng = build_engine(tiny_ckpt, zorro=True, micro_batch_size=3, zorro_settings={"logits_optimization": "memory"})
    with pytest.raises(ValueError, match=r"top-k distillation \(distillation_use_topk=True\) with "
                                         r"logits_optimization=memory"):
        with eng.eval_mode():
            eng.infer_batch(td, loss_function=loss_fn)


def test_distillation_batch_through_the_trainer_balancing_hook(teacher):
    """The distillation trainer is verl's PPO trainer: its ``_balance_batch`` is zorro's hook. On a batch carrying the
    teacher's top-k tensors and a config with distillation on, the hook regroups rows inside verl's mini-batches
    (keep_minibatches, the default), every row keeps its own teacher tensors, and the batch is stamped for the
    engine."""
    rt = pytest.importorskip("verl.trainer.ppo.ray_trainer", exc_type=ImportError)
    from omegaconf import OmegaConf
    from verl import DataProto

    from tests.integrations.verl.v09.test_balance import _trainer_self
    from zorro_verl.integrations.verl.v09.markers import BALANCE_MARKER_KEY
    from zorro_verl.testing import create_dummy_batch

    assert rt.RayPPOTrainer._balance_batch._zorro_hook
    raw = create_dummy_batch(batch_size=16, num_unique_prompts=4, prompt_len=6, response_len=4, device="cpu",
                             add_padding=True, vocab_size=128, seed=2, shuffle=True)
    raw["prompts"] = raw["input_ids"][:, :6]
    with torch.no_grad():
        vals, ids = torch.log_softmax(teacher(input_ids=raw["input_ids"], attention_mask=raw["attention_mask"]).logits,
                                      -1).topk(TOPK, -1)
    batch = DataProto.from_dict({**raw, "teacher_ids": ids, "teacher_logprobs": vals, "row": torch.arange(16)})
    me = _trainer_self(True, dp=2, mode="keep_minibatches", mini=16)
    me.config = OmegaConf.merge(me.config, {"distillation": {"enabled": True}})
    metrics = {}
    rt.RayPPOTrainer._balance_batch(me, batch, metrics)
    rows = batch.batch["row"]
    assert sorted(rows.tolist()) == list(range(16)) and rows.tolist() != list(range(16))
    assert torch.equal(batch.batch["teacher_ids"], ids[rows]) and torch.equal(batch.batch["teacher_logprobs"],
                                                                             vals[rows])
    assert metrics["zorro/balance_split_groups"] == 0 and batch.meta_info.get(BALANCE_MARKER_KEY)
