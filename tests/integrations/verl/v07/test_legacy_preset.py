"""configs/zorro_legacy.yaml composes with verl 0.7.1's own ppo_trainer (real Hydra) into validated zorro settings for
the actor (dataclass, as the worker builds it) and the reference policy (OmegaConf node, as the worker passes it)."""

from __future__ import annotations

import os

import pytest

from tests.support import REPO_ROOT

CONFIGS = str(REPO_ROOT / "configs")


def _compose(*overrides):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=os.path.abspath(CONFIGS), version_base=None):
        return compose(config_name="zorro_legacy", overrides=["actor_rollout_ref.rollout.n=4",
                                                               "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                                                               *overrides])


def test_preset_gives_zorro_actor_and_ref_settings():
    from verl.utils.config import omega_conf_to_dataclass

    from zorro_verl.integrations.verl.v07.config import ZorroLegacyFSDPEngineConfig, legacy_settings_of

    cfg = _compose("actor_rollout_ref.actor.fsdp_config.zorro.logits_optimization=compute")
    assert cfg.actor_rollout_ref.model.external_lib == "zorro_verl.integrations.verl.v07.plugin"
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert isinstance(actor.fsdp_config, ZorroLegacyFSDPEngineConfig)
    s = legacy_settings_of(actor)
    assert s.enable and s.rollout_n == 4 and s.logits_optimization == "compute" and s.on_unsupported == "raise"
    ref = legacy_settings_of(cfg.actor_rollout_ref.ref)  # the worker hands the ref its OmegaConf node
    assert ref == s
    assert isinstance(omega_conf_to_dataclass(cfg.actor_rollout_ref.ref.fsdp_config), ZorroLegacyFSDPEngineConfig)
    off = legacy_settings_of(omega_conf_to_dataclass(
        _compose("actor_rollout_ref.actor.fsdp_config.zorro.enable=false").actor_rollout_ref.actor))
    assert not off.enable
    ref_off = _compose("actor_rollout_ref.ref.fsdp_config.zorro.enable=false").actor_rollout_ref
    assert legacy_settings_of(ref_off.actor).enable and not legacy_settings_of(ref_off.ref).enable


def test_preset_rejects_unknown_key():
    from hydra.errors import InstantiationException
    from verl.utils.config import omega_conf_to_dataclass

    cfg = _compose("+actor_rollout_ref.actor.fsdp_config.zorro.logit_optimization=compute")
    with pytest.raises((ValueError, InstantiationException), match="unknown key.*logit_optimization"):
        omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
