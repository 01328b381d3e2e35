"""The reward model and the distillation teacher run in inference servers in verl 0.9.1 (no seam for zorro): a
config that asks for zorro there is refused by the trainer's constructor (before any worker starts) and by
``zorro-verl doctor``; configs without such a key pass."""

import pytest
from omegaconf import OmegaConf

from tests.integrations.verl.v09.conftest import needs_verl
from zorro_verl.integrations.verl.v09.roles import check_roles, unsupported_roles

_BASE = {"reward": {"reward_model": {"enable": True, "model_path": "rm", "rollout": {"name": "vllm"}}},
         "distillation": {"enabled": True, "teacher_models": {"teacher_model": {"model_path": "t", "inference": {}}}},
         "actor_rollout_ref": {"actor": {"fsdp_config": {"zorro": {"enable": True}}}}}


def _cfg(*dotted):
    cfg = OmegaConf.create(_BASE)
    for key in dotted:
        OmegaConf.update(cfg, key, {"enable": True}, force_add=True)
    return cfg


@pytest.mark.parametrize("key, role", [("reward.reward_model.zorro", "reward model"),
                                       ("reward_model.zorro", "reward model"),
                                       ("reward.reward_model.rollout.zorro", "reward model"),
                                       ("distillation.teacher_models.teacher_model.zorro", "distillation teacher"),
                                       ("distillation.zorro", "distillation teacher")])
def test_zorro_key_in_a_server_role_is_refused(key, role):
    (msg,) = unsupported_roles(_cfg(key))
    assert msg.startswith(f"zorro for the {role} ({key}): ") and "inside an inference server" in msg
    with pytest.raises(ValueError, match="remove the zorro key from the"):
        check_roles(_cfg(key))


def test_actor_zorro_and_server_roles_without_zorro_pass():
    assert unsupported_roles(_cfg()) == []
    check_roles(_cfg())
    check_roles(None)
    both = unsupported_roles(_cfg("reward.reward_model.zorro", "distillation.teacher_models.teacher_model.zorro"))
    assert [m.split(" (")[0] for m in both] == ["zorro for the reward model", "zorro for the distillation teacher"]


def test_doctor_reports_the_roles():
    from zorro_verl.doctor import _roles_check

    bad = _roles_check(_cfg("distillation.teacher_models.teacher_model.zorro"))
    assert bad.status == "FAIL" and "remove the zorro key from the distillation config" in bad.detail
    ok = _roles_check(_cfg())
    assert ok.status == "note" and "a model reward model and a distillation teacher" in ok.detail


@needs_verl
def test_doctor_on_the_composed_preset():
    """On the zorro preset as Hydra composes it (verl's reward / distillation nodes included): no zorro key there is a
    note, a ``+...zorro`` override under the reward model or a teacher a FAIL."""
    import torch

    from zorro_verl.doctor import run_checks

    def line(overrides):
        checks = {c.name: c for c in run_checks(overrides, torch.device("cpu"), check_plugin=False)}
        return checks["zorro (reward model / teacher)"]

    assert line([]).status == "note"
    for key in ("reward.reward_model", "distillation.teacher_models.teacher_model"):
        c = line([f"+{key}.zorro.enable=true"])
        assert c.status == "FAIL" and f"({key}.zorro)" in c.detail, c


@needs_verl
def test_trainer_constructor_refuses_before_building_anything():
    """``import verl`` loads zorro's plugin, whose post-import hook wraps ``RayPPOTrainer.__init__``: the check runs
    on the config before verl's constructor (here called with nothing else it needs)."""
    import verl  # noqa: F401 - loads the plugin entry point
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    assert getattr(RayPPOTrainer.__init__, "_zorro_roles", False)
    with pytest.raises(ValueError, match=r"zorro for the reward model \(reward.reward_model.zorro\)"):
        RayPPOTrainer(config=_cfg("reward.reward_model.zorro"), tokenizer=None, role_worker_mapping={},
                      resource_pool_manager=None)
    with pytest.raises(ValueError, match=r"zorro for the distillation teacher"):
        RayPPOTrainer(_cfg("distillation.zorro"), None, {}, None)
