"""verl 0.9.1's experimental trainers with zorro: ``OneStepOffRayTrainer`` (``verl.experimental.one_step_off_policy``)
and ``FullyAsyncTrainer`` (``verl.experimental.fully_async_policy``).

Both subclass ``RayPPOTrainer`` (through ``SeparateRayPPOTrainer``) without overriding ``_balance_batch``, so they
inherit zorro's wrapped one; one-step-off calls it from the rollout task of the next step, fully async from
``assemble_batch_from_rollout_samples``. Their runs need vLLM rollout servers (no CPU replay), so the comparison with
the stock twin is per step at the engine level on a recorded batch: each trainer's own balancing path with zorro on /
off, verl's dispatch and mini-batch iterator over 2 gloo ranks, then the zorro engine on the zorro placement vs the
stock engine on verl's placement, two optimizer steps (SGD, fp32): the same rows in every optimizer step, log-probs
(matched by row) <= 1e-5 abs, loss / grad norm / every gradient <= 1e-5 relative, no fallback, the balance stamp at
the engine, and more deduplication than verl's placement allows.
"""

import types

import pytest

from tests.support import HANG_TIMEOUT_S

pytestmark = pytest.mark.usefixtures("verl_cpu")  # skips without verl 0.9

ATOL = 1e-5
RTOL = 1e-5


def _classes():
    from tests.support.verl_async_trainers import TRAINERS, trainer_class

    return {name: trainer_class(name) for name in TRAINERS}


def test_trainers_inherit_zorros_balance_hook():
    import inspect

    import verl.trainer.ppo.ray_trainer as rt

    for name, cls in _classes().items():
        assert issubclass(cls, rt.RayPPOTrainer), name
        owners = [c for c in cls.__mro__ if "_balance_batch" in vars(c)]
        assert owners[0] is rt.RayPPOTrainer, (name, owners)  # no re-implementation between them
        assert cls._balance_batch is rt.RayPPOTrainer._balance_batch and cls._balance_batch._zorro_hook, name
    # the seams the trainers balance through (a verl that moves them fails here)
    assert "self._balance_batch(batch, metrics=metrics)" in inspect.getsource(
        _classes()["one_step_off"]._async_gen_next_batch)
    assert "assemble_batch_from_rollout_samples(queue_samples, self.tokenizer, self.config, self._balance_batch)" \
        in inspect.getsource(_classes()["fully_async"]._get_samples_from_queue)


def _slots_trainer(cls, global_steps, critic_warmup):
    from omegaconf import OmegaConf

    t = cls.__new__(cls)
    t.config = OmegaConf.create({
        "trainer": {"critic_warmup": critic_warmup},
        "actor_rollout_ref": {"rollout": {"n": 2}, "actor": {"ppo_mini_batch_size": 2, "ppo_epochs": 1,
                                                             "shuffle": False, "data_loader_seed": 42}},
        "critic": {"ppo_mini_batch_size": 4, "ppo_epochs": 1, "shuffle": False, "data_loader_seed": 42}})
    t.global_steps, t.use_critic = global_steps, True
    t.actor_rollout_wg = types.SimpleNamespace(_dispatch_info={"actor": [0, 1]})
    t.critic_wg = types.SimpleNamespace(_dispatch_info={"train": [0, 1]})
    return t


def test_one_step_off_keeps_the_actors_minibatches_a_step_ahead():
    """One-step-off balances step k+1's batch while step k trains: with critic_warmup = k + 1 the actor updates on
    that batch, so its mini-batches must constrain the placement although ``global_steps`` is still k."""
    import verl.trainer.ppo.ray_trainer as rt

    from zorro_verl.integrations.verl.v09.balance import trainer_minibatch_slots

    def roles(t):
        return {x for s in trainer_minibatch_slots(t, 8) for x in s if isinstance(x, str)}

    classes = _classes()
    assert roles(_slots_trainer(classes["one_step_off"], 1, 2)) == {"actor", "critic"}
    # the trainers that balance the batch of the step they train read the step as it is
    for cls in (rt.RayPPOTrainer, classes["fully_async"]):
        assert roles(_slots_trainer(cls, 1, 2)) == {"critic"}
        assert roles(_slots_trainer(cls, 2, 2)) == {"actor", "critic"}


@pytest.fixture(scope="module")
def two_ranks(verl_cpu, tiny_ckpt, tmp_path_factory):
    import time

    from tests.support.multi_rank import run_ranks

    t0 = time.perf_counter()
    res = run_ranks("tests.support.verl_async_trainers", 2, [tiny_ckpt], tmp_path_factory.mktemp("async"),
                    HANG_TIMEOUT_S)
    print(f"2 ranks: {time.perf_counter() - t0:.0f} s (ranks {[round(r['seconds']) for r in res]} s)")
    return res


@pytest.mark.parametrize("name", ["one_step_off", "fully_async"])
def test_engine_steps_on_the_trainers_placement_match_stock(two_ranks, name):
    for r in two_ranks:
        res = r["trainers"][name]
        orders = res["orders"]
        assert sorted(orders["True"]) == sorted(orders["False"]) == list(range(len(orders["True"])))
        assert orders["True"] != orders["False"]  # zorro moved rows
        assert res["meta"]["True"].get("zorro_balance_hook") is True
        assert res["dedup"]["True"] > res["dedup"]["False"], res["dedup"]
        assert len(res["steps"]) == 2
        for k, e in enumerate(res["steps"]):
            print(f"{name} rank {r['rank']} step {k}: log-prob {e['log_probs']:.1e}, loss "
                  f"{abs(e['loss'][0] - e['loss'][1]) / abs(e['loss'][0]):.1e}, grad norm "
                  f"{abs(e['grad_norm'][0] - e['grad_norm'][1]) / e['grad_norm'][0]:.1e}, grads {e['grad_rel']:.1e}; "
                  f"dedup {res['dedup']['False']:.2f} (verl's placement) -> {res['dedup']['True']:.2f}")
            assert e["rows_stock"] == e["rows_zorro"] and e["lengths_match"], (k, e)  # stock's optimizer steps
            assert e["log_probs_scale"] > 0.1 and e["log_probs"] <= ATOL, (k, e)
            la, lb = e["loss"]
            assert abs(la) > 1e-4 and abs(la - lb) <= RTOL * abs(la), (k, e)
            ga, gb = e["grad_norm"]
            assert ga > 1e-5 and abs(ga - gb) <= RTOL * ga, (k, e)
            assert e["grad_rel"] <= RTOL, (k, e)
            assert e["fallback"] == [0.0, 0.0] and e["hooks_missing"] == 0.0, (k, e)
    if name == "one_step_off":  # verl keeps the metrics of this call; fully async passes metrics={} and drops them
        res = two_ranks[0]["trainers"][name]
        m = res["metrics"]["True"]
        # zorro regrouped inside verl's optimizer-step slots (one per mini-batch), without falling back
        assert m["zorro/balance_minibatch_slots"] == len(res["steps"]) and m.get("zorro/balance_fallbacks", 0) == 0
