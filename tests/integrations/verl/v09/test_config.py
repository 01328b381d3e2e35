"""The Hydra preset and the plugin config dataclass: composed with verl 0.9.1's own ppo_trainer config."""

import os
import subprocess
import sys

import pytest

from tests.support import HANG_TIMEOUT_S, REPO_ROOT
from zorro_verl.integrations.verl.presets import preset_dir

pytestmark = pytest.mark.usefixtures("verl_cpu")

CONFIGS = preset_dir()  # the package's presets (configs/ in the checkout links to them)


def _compose(overrides=()):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=os.path.abspath(CONFIGS), version_base=None):
        base = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                "actor_rollout_ref.actor.ppo_mini_batch_size=8", "data.train_batch_size=8"]
        return compose(config_name="zorro_ppo_trainer", overrides=base + list(overrides))


def test_preset_builds_zorro_engine_configs():
    from verl.utils.config import omega_conf_to_dataclass

    from zorro_verl.integrations.verl.settings import settings_of as zorro_settings_of
    from zorro_verl.integrations.verl.v09.config import ZorroFSDPEngineConfig

    cfg = _compose(["actor_rollout_ref.rollout.n=5", "actor_rollout_ref.actor.fsdp_config.zorro.on_unsupported=warn"])
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert isinstance(actor.fsdp_config, ZorroFSDPEngineConfig) and actor.engine is actor.fsdp_config
    s = zorro_settings_of(actor.engine)
    assert (s.enable, s.rollout_n, s.on_unsupported, s.group_balance) == (True, 5, "warn", True)
    ref = omega_conf_to_dataclass(cfg.actor_rollout_ref.ref.fsdp_config)
    assert isinstance(ref, ZorroFSDPEngineConfig)
    rs = zorro_settings_of(ref)
    assert (rs.enable, rs.rollout_n, rs.on_unsupported) == (True, 5, "warn")
    # the override that turns it off leaves verl's config otherwise unchanged
    off = _compose(["actor_rollout_ref.actor.fsdp_config.zorro.enable=false"])
    assert zorro_settings_of(omega_conf_to_dataclass(off.actor_rollout_ref.ref.fsdp_config)).enable is False


def _compose_megatron(overrides=()):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=os.path.abspath(CONFIGS), version_base=None):
        return compose(config_name="zorro_megatron_trainer", overrides=list(overrides))


def test_megatron_preset_builds_zorro_mcore_engine_configs():
    """The Megatron preset is verl's ppo_trainer with model_engine=megatron: strategy megatron for actor and ref,
    their `megatron` nodes select ZorroMcoreEngineConfig with the zorro keys (the ref's follow the actor's), verl's
    other Megatron keys unchanged. Disabled, it builds in any environment; enabled, it needs verl's Megatron engine
    (megatron-core) and says so at construction when it is missing."""
    import importlib.util

    from verl.utils.config import omega_conf_to_dataclass

    from zorro_verl.integrations.verl.settings import settings_of as zorro_settings_of
    from zorro_verl.integrations.verl.v09.config import ZorroMcoreEngineConfig

    cfg = _compose_megatron(["actor_rollout_ref.rollout.n=5", "actor_rollout_ref.actor.megatron.zorro.sharing=prefix"])
    assert cfg.model_engine == "megatron"
    assert cfg.actor_rollout_ref.model.external_lib == "zorro_verl.integrations.verl.v09.plugin"
    for role in ("actor", "ref"):
        node = cfg.actor_rollout_ref[role]
        assert node.strategy == "megatron" and "fsdp_config" not in node
        assert node.megatron._target_ == "zorro_verl.integrations.verl.v09.config.ZorroMcoreEngineConfig"
        z = node.megatron.zorro
        assert (z.enable, z.rollout_n, z.sharing, z.group_balance) == (True, 5, "prefix", True)
        assert node.megatron.context_parallel_size == 1 and node.megatron.sequence_parallel is True
    off = _compose_megatron(["actor_rollout_ref.actor.megatron.zorro.enable=false"])
    for role in ("actor", "ref"):
        built = omega_conf_to_dataclass(off.actor_rollout_ref[role].megatron)
        assert isinstance(built, ZorroMcoreEngineConfig) and zorro_settings_of(built).enable is False
    if importlib.util.find_spec("megatron") is None:
        with pytest.raises(Exception, match="megatron-core"):
            omega_conf_to_dataclass(cfg.actor_rollout_ref.actor.megatron)
    else:
        assert zorro_settings_of(omega_conf_to_dataclass(cfg.actor_rollout_ref.actor.megatron)).enable


@pytest.mark.parametrize("override, key", [
    ("actor_rollout_ref.actor.fsdp_config.zorro.logits_optimization=fast", "logits_optimization"),
    ("+actor_rollout_ref.actor.fsdp_config.zorro.bogus=1", "bogus"),
    ("actor_rollout_ref.actor.fsdp_config.zorro.on_unsupported=ignore", "on_unsupported"),
])
def test_preset_rejects_bad_values(override, key):
    from verl.utils.config import omega_conf_to_dataclass

    cfg = _compose([override])
    with pytest.raises(Exception, match=key) as info:
        omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    # Hydra wraps the ValueError; the message still names the key and the fix
    assert "zorro" in str(info.value)


def test_self_check_when_another_engine_is_registered():
    from verl.workers.engine import EngineRegistry, FSDPEngineWithLMHead

    from zorro_verl.integrations.verl.v09.registration import check_engine_registered

    slots = EngineRegistry._engines["language_model"]["fsdp2"]
    saved = slots["cpu"]
    slots["cpu"] = FSDPEngineWithLMHead
    try:
        with pytest.raises(RuntimeError, match="not the zorro engine"):
            check_engine_registered()
    finally:
        slots["cpu"] = saved
    check_engine_registered()


def test_self_check_names_strategy_and_device_when_verl_has_no_engine(monkeypatch):
    """verl's EngineRegistry asserts on an unknown backend and raises ValueError for an unknown device: the check
    turns both into a RuntimeError naming the strategy, the device and the fix."""
    from verl.workers.engine import EngineRegistry

    from zorro_verl.integrations.verl.v09.registration import check_engine_registered

    table = EngineRegistry._engines["language_model"]
    monkeypatch.delitem(table, "fsdp")  # unknown backend: a bare AssertionError inside verl
    with pytest.raises(RuntimeError, match=r"strategy 'fsdp' on device 'cpu'.*AssertionError.*strategy fsdp or fsdp2"):
        check_engine_registered()
    monkeypatch.undo()
    monkeypatch.setenv("VERL_ENGINE_DEVICE", "tpu")  # a device no engine is registered for: ValueError inside verl
    with pytest.raises(RuntimeError, match=r"strategy 'fsdp' on device 'tpu'.*VERL_ENGINE_DEVICE"):
        check_engine_registered()
    monkeypatch.undo()
    check_engine_registered()


def _fresh_python(code: str, **env) -> subprocess.CompletedProcess:
    from tests.support.verl_cpu_platform import worker_env

    return subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **worker_env(), **env),
                          capture_output=True, text=True, timeout=HANG_TIMEOUT_S)


def test_entry_point_registers_at_import_verl():
    """`import verl` in a fresh process loads the verl.plugins entry point (needs the pyproject entry point); it
    imports nothing heavy — verl's engine package is loaded only when used, and then holds the zorro engine."""
    import importlib.metadata as md

    # pyproject.toml declares the entry point: an install without it is a packaging defect, not a skip.
    assert any(ep.name == "zorro_verl" for ep in md.entry_points(group="verl.plugins")), \
        "zorro-verl's verl.plugins entry point is not installed (reinstall with pip install -e .)"
    code = ("import sys, verl\n"
            "assert 'zorro_verl.integrations.verl.v09.plugin' in sys.modules\n"
            "assert 'verl.workers.engine' not in sys.modules and 'zorro_verl.integrations.verl.v09.engine' not in "
            "sys.modules\n"
            "from verl.workers.engine import EngineRegistry\n"
            "from zorro_verl.integrations.verl.v09.engine import ZorroFSDPEngineWithLMHead as Z\n"
            "t = EngineRegistry._engines['language_model']\n"
            "assert all(c is Z for b in ('fsdp', 'fsdp2') for c in t[b].values()), t\n"
            "print('ok')\n")
    out = _fresh_python(code)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_enabled_config_without_plugin_stops_at_start():
    """With the plugin switched off, a zorro-enabled config raises at construction, saying why (no silent stock
    run); a disabled config still builds."""
    code = ("from zorro_verl.integrations.verl.v09.config import ZorroFSDPEngineConfig\n"
            "ZorroFSDPEngineConfig(zorro={'enable': False})\n"
            "try:\n"
            "    ZorroFSDPEngineConfig(zorro={'enable': True})\n"
            "except RuntimeError as e:\n"
            "    print('refused:', e)\n")
    out = _fresh_python(code, ZORRO_VERL_PLUGIN_DISABLE="1")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "refused: zorro is enabled in the config but its verl plugin is not loaded" in out.stdout
    assert "ZORRO_VERL_PLUGIN_DISABLE=1" in out.stdout


def _example_overrides():
    """The Hydra overrides of examples/grpo_qwen3_vllm_common.sh, shell variables replaced by sample values."""
    import re

    path = REPO_ROOT / "examples" / "grpo_qwen3_vllm_common.sh"
    values = {"DATA_DIR": "/data", "MODEL": "Qwen/Qwen3-1.7B", "ROLLOUT_N": "8", "EXP": "x", "NGPUS": "8",
              "NNODES": "1"}
    out = []
    for line in open(path):
        m = re.match(r"\s+([a-z_.]+=\S+)", line)
        if m:
            ov = m.group(1).replace('"', "").replace("'", "")
            out.append(re.sub(r"\$(\w+)", lambda v: values[v.group(1)], ov))
    assert len(out) > 20
    return out


@pytest.mark.parametrize("extra, enabled", [([], True), (["actor_rollout_ref.actor.fsdp_config.zorro.enable=false"],
                                                          False)])
def test_example_launch_lines_compose(extra, enabled):
    """The zorro example and its baseline twin compose against verl 0.9.1's config and differ only in `enable`."""
    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass

    from zorro_verl.integrations.verl.settings import settings_of as zorro_settings_of

    with initialize_config_dir(config_dir=os.path.abspath(CONFIGS), version_base=None):
        cfg = compose(config_name="zorro_ppo_trainer", overrides=_example_overrides() + extra)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    ref = omega_conf_to_dataclass(cfg.actor_rollout_ref.ref.fsdp_config)
    assert zorro_settings_of(actor.engine).enable is enabled and zorro_settings_of(ref).enable is enabled
    assert zorro_settings_of(actor.engine).rollout_n == cfg.actor_rollout_ref.rollout.n == 8
    assert actor.strategy == "fsdp2" and cfg.actor_rollout_ref.rollout.name == "vllm"


def test_other_strategies_refuse_zorro():
    """fsdp_turbo reads the same fsdp_config: with zorro enabled its engine refuses to start (no silent stock run)."""
    from verl.workers.config import HFModelConfig  # noqa: F401  (verl's engine package is importable)
    from verl.workers.engine import EngineRegistry

    from zorro_verl.integrations.verl.v09.config import ZorroFSDPEngineConfig

    turbo = EngineRegistry._engines["language_model"]["fsdp_turbo"]["cuda"]
    assert turbo._zorro_guard
    cfg = ZorroFSDPEngineConfig(strategy="fsdp_turbo", zorro={"enable": True})
    with pytest.raises(RuntimeError, match="fsdp_turbo"):
        turbo(model_config=None, engine_config=cfg, optimizer_config=None, checkpoint_config=None)


def test_critic_config_builds_the_zorro_value_engine(tiny_ckpt):
    """A critic (value-model engine) whose engine config (`critic.fsdp`) enables zorro builds zorro's value-head
    engine: the plugin registered it for value_model on fsdp / fsdp2 (every device key, plus cpu); a plain critic
    config builds the same class with zorro off (verl's stock forward). Other value-model backends (here Megatron's, as
    where megatron-core does not import; with it, zorro's Megatron value engine: test_value_engine.py) refuse
    a zorro-enabled config at construction, naming the key to remove."""
    from verl.trainer.config.config import CheckpointConfig
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithValueHead

    from zorro_verl.integrations.verl.settings import settings_of as zorro_settings_of
    from zorro_verl.integrations.verl.v09 import registration
    from zorro_verl.integrations.verl.v09.value_engine import ZorroFSDPEngineWithValueHead

    # the critic's engine config (verl's FSDPCriticConfig.engine is its `fsdp` node): the preset enables zorro there
    # with the actor's switch
    critic = omega_conf_to_dataclass(_compose().critic.fsdp)
    assert zorro_settings_of(critic).enable
    plain = omega_conf_to_dataclass(_compose(["actor_rollout_ref.actor.fsdp_config.zorro.enable=false"]).critic.fsdp)
    value_engines = EngineRegistry._engines["value_model"]
    assert all(c is ZorroFSDPEngineWithValueHead for b in ("fsdp", "fsdp2") for c in value_engines[b].values())
    assert {"cuda", "cpu"} <= set(value_engines["fsdp2"])
    cls = value_engines["fsdp2"]["cuda"]
    kw = dict(model_config=HFModelConfig(path=tiny_ckpt, load_tokenizer=False, model_type="value_model"),
              optimizer_config=FSDPOptimizerConfig(lr=0.0, total_training_steps=1),
              checkpoint_config=CheckpointConfig())
    assert cls(engine_config=critic, **kw).zorro.enable
    assert not cls(engine_config=plain, **kw).zorro.enable  # no zorro in the config: verl's stock forward
    guarded = registration._value_model_guarded(FSDPEngineWithValueHead, "megatron")
    with pytest.raises(ValueError, match=r"critic\.megatron\.zorro: expected no zorro node .* got enable=true") as info:
        guarded(engine_config=critic, **kw)
    assert "critic.megatron.zorro.enable=false" in str(info.value) and "stock forward" in str(info.value)
    assert isinstance(guarded(engine_config=plain, **kw), FSDPEngineWithValueHead)


def test_main_ppo_finds_the_preset_inside_the_package(tmp_path):
    """verl's own entry point, run from an unrelated folder, composes the preset from the installed package
    (`--config-path=pkg://zorro_verl.configs`) — the launch line of the README and docs/verl-fsdp.md; `--cfg job`
    prints it and exits."""
    from zorro_verl.integrations.verl.presets import PRESET_SEARCH_PATH

    out = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", f"--config-path={PRESET_SEARCH_PATH}",
                          "--config-name=zorro_ppo_trainer", "--cfg", "job", "actor_rollout_ref.rollout.n=6"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=HANG_TIMEOUT_S)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "_target_: zorro_verl.integrations.verl.v09.config.ZorroFSDPEngineConfig" in out.stdout
    assert "external_lib: zorro_verl.integrations.verl.v09.plugin" in out.stdout
    out = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", f"--config-path={PRESET_SEARCH_PATH}",
                          "--config-name=zorro_megatron_trainer", "--cfg", "job"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=HANG_TIMEOUT_S)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "_target_: zorro_verl.integrations.verl.v09.config.ZorroMcoreEngineConfig" in out.stdout
    assert "strategy: megatron" in out.stdout


def test_engine_modules_imported_before_verls_engines(tmp_path):
    """A process that imports a zorro engine module before verl's engines (its import of verl's engines runs the
    registration hook while the zorro module is half-imported) gets the zorro engines registered once a zorro config
    is built, instead of an ImportError from the hook."""
    script = ("import os\n"
              "from tests.support.verl_cpu_platform import use_cpu_platform\n"
              "use_cpu_platform()\n"
              "os.environ['VERL_ENGINE_DEVICE'] = 'cpu'\n"
              "import zorro_verl.integrations.verl.v09.value_engine\n"
              "import zorro_verl.integrations.verl.v09.engine\n"
              "from verl.workers.engine import EngineRegistry\n"
              "from zorro_verl.integrations.verl.v09.config import ZorroFSDPEngineConfig\n"
              "ZorroFSDPEngineConfig(zorro={'enable': True})\n"
              "print(sorted({c.__name__ for m in ('language_model', 'value_model') for b in ('fsdp', 'fsdp2')\n"
              "              for c in EngineRegistry._engines[m][b].values()}))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=HANG_TIMEOUT_S,
                         env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "['ZorroFSDPEngineWithLMHead', 'ZorroFSDPEngineWithValueHead']"
