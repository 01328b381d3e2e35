"""Switching zorro on for an existing verl command line with `key=value` overrides only (no config file of ours):
the exact lines docs/verl-fsdp.md shows, composed with verl 0.9.1's own `ppo_trainer` config."""

import re
from pathlib import Path

import pytest

from tests.support import REPO_ROOT

pytestmark = pytest.mark.usefixtures("verl_cpu")


def documented_overrides() -> list[str]:
    """The override lines of docs/verl-fsdp.md's "overrides only" block (between its markers)."""
    text = (REPO_ROOT / "docs" / "verl-fsdp.md").read_text()
    block = re.search(r"<!-- zorro-overrides -->\s*```bash\n(.*?)```", text, re.S)
    assert block, "docs/verl-fsdp.md lost its overrides-only block"
    return [tok for tok in block.group(1).split() if "=" in tok and not tok.startswith("--")]


def _actor_and_ref(cfg):
    """The actor's and the reference's config dataclasses, as verl's engine worker builds them (it renames the
    ref's ``log_prob_*`` keys to the actor's names first)."""
    from omegaconf import open_dict
    from verl.utils.config import omega_conf_to_dataclass

    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    node = cfg.actor_rollout_ref.ref
    with open_dict(node):
        node.ppo_mini_batch_size = actor.ppo_mini_batch_size
        for old, new in (("log_prob_micro_batch_size", "ppo_micro_batch_size"),
                         ("log_prob_micro_batch_size_per_gpu", "ppo_micro_batch_size_per_gpu"),
                         ("log_prob_use_dynamic_bsz", "use_dynamic_bsz"),
                         ("log_prob_max_token_len_per_gpu", "ppo_max_token_len_per_gpu")):
            node[new] = node.pop(old, None)
    return actor, omega_conf_to_dataclass(node)


def test_documented_overrides_build_the_zorro_engine_for_actor_and_ref():
    import verl
    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.engine import EngineRegistry

    from zorro_verl.integrations.verl.settings import settings_of

    overrides = documented_overrides()
    assert len(overrides) == 4
    config_dir = str(Path(verl.__file__).parent / "trainer" / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=overrides + [
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "data.train_batch_size=8", "actor_rollout_ref.rollout.n=4"])
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    ref = omega_conf_to_dataclass(cfg.actor_rollout_ref.ref.fsdp_config)
    for engine_config in (actor.engine, ref):
        s = settings_of(engine_config)
        assert s.enable and s.attention_backend == "auto" and s.group_balance
        cls = EngineRegistry.get_engine_cls("language_model", engine_config.strategy)
        assert getattr(cls, "zorro_engine", False), cls
    # without the overrides, verl's own config builds a stock engine config
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        plain = compose(config_name="ppo_trainer", overrides=["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                                                              "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                                                              "data.train_batch_size=8"])
    assert not settings_of(omega_conf_to_dataclass(plain.actor_rollout_ref.actor).engine).enable


def test_documented_ulysses_launch_line_composes_with_the_preset():
    """docs/verl-fsdp.md's long-context line (16K prompts, n = 16, SP = 4) composes with the preset into zorro engine
    configs with SP = 4 for actor and reference, and its token budget holds a whole group per SP group."""
    from hydra import compose, initialize_config_dir

    from zorro_verl.integrations.verl.presets import preset_dir
    from zorro_verl.integrations.verl.settings import settings_of

    text = (REPO_ROOT / "docs" / "verl-fsdp.md").read_text()
    block = re.search(r"<!-- zorro-ulysses -->\s*```bash\n(.*?)```", text, re.S)
    assert block, "docs/verl-fsdp.md lost its Ulysses launch block"
    overrides = [t for t in block.group(1).split() if "=" in t and not t.startswith("--")]
    with initialize_config_dir(config_dir=preset_dir(), version_base=None):
        cfg = compose(config_name="zorro_ppo_trainer", overrides=overrides + [
            "actor_rollout_ref.actor.ppo_mini_batch_size=16", "data.train_batch_size=16"])
    actor, ref = _actor_and_ref(cfg)
    for c in (actor, ref):
        assert c.ulysses_sequence_parallel_size == 4 and c.engine.ulysses_sequence_parallel_size == 4
        assert settings_of(c.engine).enable
    group = cfg.data.max_prompt_length + cfg.actor_rollout_ref.rollout.n * cfg.data.max_response_length
    assert group <= actor.ppo_max_token_len_per_gpu * 4


def test_e2e_overrides_select_the_strategy(strategy):
    """The end-to-end runs' overrides (tests/e2e/runner.py: ``base_overrides(strategy=...)`` with the CPU and
    micro-batch overrides) compose with the preset into actor and reference engine configs of that strategy, and
    verl's registry resolves the zorro engine for it (the reference's ``strategy`` follows the actor's in verl's
    config; its worker renames the ``log_prob_*`` keys before building it, as here)."""
    from hydra import compose, initialize_config_dir
    from verl.workers.engine import EngineRegistry

    from tests.e2e.runner import base_overrides, micro_batch_overrides
    from tests.support.verl_cpu_e2e import cpu_overrides
    from zorro_verl.integrations.verl.presets import preset_dir
    from zorro_verl.integrations.verl.settings import settings_of

    assets = {"num_prompts": 4, "model": "/m", "train": "/t.parquet", "reward": "/r.py"}
    overrides = (base_overrides(assets, out_dir=Path("/tmp/run"), strategy=strategy) + cpu_overrides(1)
                 + micro_batch_overrides(dynamic=False))
    with initialize_config_dir(config_dir=preset_dir(), version_base=None):
        cfg = compose(config_name="zorro_ppo_trainer", overrides=overrides)
    assert cfg.actor_rollout_ref.ref.strategy == strategy
    actor, ref = _actor_and_ref(cfg)
    for c in (actor, ref):
        assert c.strategy == c.engine.strategy == strategy and settings_of(c.engine).enable
        assert getattr(EngineRegistry.get_engine_cls("language_model", c.engine.strategy), "zorro_engine", False)
    with pytest.raises(ValueError, match="strategy"):
        base_overrides(assets, out_dir=Path("/tmp/run"), strategy="dp")


def test_e2e_megatron_overrides_compose():
    """The end-to-end Megatron runs' overrides (``base_overrides(strategy="megatron")`` with the CPU and micro-batch
    overrides) compose with the ``zorro_megatron_trainer`` preset: verl's Megatron engine for actor and reference,
    fp32 both (the CPU runs' V2), the requested TP size, verl's default builder (Megatron-Bridge), megatron-core
    without fused CUDA kernels and without the distributed optimizer (megatron's refuses SGD); other dtypes are
    refused by name."""
    from hydra import compose, initialize_config_dir

    from tests.e2e.runner import MEGATRON_CPU_TRANSFORMER, base_overrides, micro_batch_overrides
    from tests.support.verl_cpu_e2e import cpu_overrides
    from zorro_verl.integrations.verl.presets import preset_dir

    assets = {"num_prompts": 4, "model": "/m", "train": "/t.parquet", "reward": "/r.py"}
    overrides = (base_overrides(assets, out_dir=Path("/tmp/run"), strategy="megatron", tp=2) + cpu_overrides(2)
                 + micro_batch_overrides(dynamic=True))
    with initialize_config_dir(config_dir=preset_dir(), version_base=None):
        cfg = compose(config_name="zorro_megatron_trainer", overrides=overrides)
    assert cfg.model_engine == "megatron"
    actor, ref = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.ref
    assert actor.strategy == ref.strategy == "megatron"
    for m in (actor.megatron, ref.megatron):
        assert m.dtype == "float32" and m.tensor_model_parallel_size == 2 and not m.vanilla_mbridge
        assert m.zorro.enable and m.use_remove_padding
        for k, v in MEGATRON_CPU_TRANSFORMER.items():
            assert m.override_transformer_config[k] == v, k
    assert actor.megatron.use_distributed_optimizer is False
    with pytest.raises(ValueError, match="fp32"):
        base_overrides(assets, out_dir=Path("/tmp/run"), strategy="megatron", dtype="bf16")


def test_documented_critic_overrides_and_preset_build_the_zorro_value_engine():
    """docs/verl-fsdp.md's critic block, composed with verl's own ppo_trainer, gives the critic a zorro engine config
    that verl resolves to zorro's value-model engine; the preset switches the critic with the actor."""
    import verl
    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.engine import EngineRegistry

    from zorro_verl.integrations.verl.presets import preset_dir
    from zorro_verl.integrations.verl.settings import settings_of

    text = (REPO_ROOT / "docs" / "verl-fsdp.md").read_text()
    block = re.search(r"<!-- zorro-critic-overrides -->\s*```bash\n(.*?)```", text, re.S)
    assert block, "docs/verl-fsdp.md lost its critic overrides block"
    overrides = [tok for tok in block.group(1).split() if "=" in tok and not tok.startswith("--")]
    assert len(overrides) == 3
    with initialize_config_dir(config_dir=str(Path(verl.__file__).parent / "trainer" / "config"), version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=overrides)
    engine = omega_conf_to_dataclass(cfg.critic.fsdp)
    assert settings_of(engine).enable and cfg.algorithm.adv_estimator == "gae"
    assert getattr(EngineRegistry.get_engine_cls("value_model", engine.strategy), "zorro_engine", False)
    for actor_on in (True, False):
        with initialize_config_dir(config_dir=preset_dir(), version_base=None):
            cfg = compose(config_name="zorro_ppo_trainer", overrides=[
                f"actor_rollout_ref.actor.fsdp_config.zorro.enable={str(actor_on).lower()}"])
        assert settings_of(omega_conf_to_dataclass(cfg.critic.fsdp)).enable == actor_on
