"""configs/zorro_legacy.yaml composes with verl 0.7.1's own ppo_trainer (real Hydra) into validated zorro settings for
the actor (dataclass, as the worker builds it) and the reference policy (OmegaConf node, as the worker passes it)."""

from __future__ import annotations

import os

import pytest

from tests.support import REPO_ROOT

CONFIGS = str(REPO_ROOT / "zorro_verl" / "configs")  # the package's presets


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
    assert s.sharing == "prompt" and s.min_shared_len == 64
    tree = _compose("actor_rollout_ref.actor.fsdp_config.zorro.sharing=prefix",
                    "actor_rollout_ref.actor.fsdp_config.zorro.min_shared_len=16")
    t = legacy_settings_of(omega_conf_to_dataclass(tree.actor_rollout_ref.actor))
    assert t.sharing == "prefix" and t.min_shared_len == 16
    assert legacy_settings_of(tree.actor_rollout_ref.ref) == t  # the ref follows the actor
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


def test_new_engine_workers_refuse_zorro():
    """``trainer.use_legacy_worker_impl=disable`` makes verl 0.7 build ``verl.workers.engine_workers``, which never
    constructs the legacy actor: with zorro enabled the engine config is refused where those workers (and only they)
    wrap it, in ``TrainingWorkerConfig`` (built as their ``init_model`` builds it), instead of training the stock
    way."""
    from omegaconf import open_dict
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import TrainingWorkerConfig

    cfg = _compose("trainer.use_legacy_worker_impl=disable",
                   "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4")
    ref = cfg.actor_rollout_ref.ref
    with open_dict(ref):  # the renames engine_workers.ActorRolloutRefWorker.init_model applies to the ref node
        ref.ppo_mini_batch_size = cfg.actor_rollout_ref.actor.ppo_mini_batch_size
        ref.ppo_micro_batch_size = ref.pop("log_prob_micro_batch_size", None)
        ref.ppo_micro_batch_size_per_gpu = ref.pop("log_prob_micro_batch_size_per_gpu", None)
        ref.use_dynamic_bsz = ref.pop("log_prob_use_dynamic_bsz", False)
        ref.ppo_max_token_len_per_gpu = ref.pop("log_prob_max_token_len_per_gpu", None)
    for node in (cfg.actor_rollout_ref.actor, ref):
        actor = omega_conf_to_dataclass(node)
        with pytest.raises(RuntimeError, match="use_legacy_worker_impl=auto"):
            TrainingWorkerConfig(model_type="language_model", model_config=None, engine_config=actor.engine,
                                 optimizer_config=actor.optim, checkpoint_config=actor.checkpoint)
    # zorro off: verl's new workers are untouched
    off = _compose("trainer.use_legacy_worker_impl=disable", "actor_rollout_ref.actor.fsdp_config.zorro.enable=false")
    actor = omega_conf_to_dataclass(off.actor_rollout_ref.actor)
    TrainingWorkerConfig(model_type="language_model", engine_config=actor.engine, optimizer_config=actor.optim)
