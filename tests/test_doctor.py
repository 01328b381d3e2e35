"""``zorro-verl doctor``: the command users run before a zorro-enabled verl job (real subprocesses of the CLI)."""

import os
import subprocess
import sys

import pytest
import torch

from tests.support import HANG_TIMEOUT_S

pytest.importorskip("verl")


def _doctor(*args, **env):
    return subprocess.run([sys.executable, "-m", "zorro_verl.cli", "doctor", *args], capture_output=True, text=True,
                          timeout=HANG_TIMEOUT_S, env=dict(os.environ, **env))


def _line(out: str, name: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(name))


def test_ready_setup_reports_versions_plugin_backend_and_exits_0():
    out = _doctor()
    assert out.returncode == 0, out.stdout + out.stderr
    for name in ("torch", "transformers", "verl", "flash-attn", "flash-linear-attention", "causal-conv1d", "mamba-ssm",
                 "vLLM"):
        assert _line(out.stdout, name)
    assert " ok " in _line(out.stdout, "verl plugin")
    assert "auto -> flash_copyfree" in _line(out.stdout, "attention backend")  # this CPU host
    assert "result: ready" in out.stdout


def test_run_that_would_fail_at_start_exits_1_and_says_why():
    out = _doctor("actor_rollout_ref.actor.fsdp_config.zorro.attention_backend=flash", "--device", "cpu")
    assert out.returncode == 1
    assert "FAIL" in _line(out.stdout, "zorro (actor)") and "'flash' cannot run" in out.stdout
    out = _doctor(ZORRO_VERL_PLUGIN_DISABLE="1")
    assert out.returncode == 1 and "ZORRO_VERL_PLUGIN_DISABLE=1" in _line(out.stdout, "verl plugin")


def test_config_checks_in_process():
    from zorro_verl.doctor import run_checks

    cpu = torch.device("cpu")

    def status(overrides, name):
        checks = {c.name: c for c in run_checks(overrides, cpu, check_plugin=False)}
        return checks[name].status, checks[name].detail

    assert status([], "zorro (ref)")[0] == "ok"
    s, detail = status(["actor_rollout_ref.actor.fsdp_config.zorro.logits_optimization=fast"], "zorro (actor)")
    assert s == "FAIL" and "logits_optimization" in detail
    s, detail = status(["actor_rollout_ref.actor.strategy=megatron"], "zorro (actor)")
    assert s == "FAIL" and "strategy 'megatron'" in detail
    assert status(["actor_rollout_ref.actor.fsdp_config.zorro.enable=false"], "zorro (actor)")[0] == "note"
    # the 0.9 engine runs zorro under Ulysses sequence parallelism
    assert status(["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"], "zorro (actor)")[0] == "ok"
    s, detail = status(["actor_rollout_ref.model.lora_rank=8"], "zorro (actor)")  # LoRA runs deduplicated
    assert s == "ok" and "LoRA rank 8 supported" in detail
    assert "adapter disabled" in status(["actor_rollout_ref.model.lora_rank=8"], "zorro (ref)")[1]
    norm = ["actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm"]
    s, detail = status(norm + ["actor_rollout_ref.actor.fsdp_config.zorro.on_unsupported=warn"], "zorro (actor)")
    assert s == "note" and "zorro/fallback_batches" in detail
    s, detail = status(norm, "zorro (actor)")  # the V1 trainer's nested response mask: refused, the fix named
    assert s == "FAIL" and "loss_scale_factor" in detail
    assert status(norm + ["actor_rollout_ref.actor.loss_scale_factor=64"], "zorro (actor)")[0] == "ok"
    assert status(norm + ["trainer.use_v1=false"], "zorro (actor)")[0] == "ok"  # padded [B, R] mask: equal
    # the critic: no critic without GAE (verl's default estimator); with one, the preset runs zorro's value engine
    # (or the stock one when off)
    s, detail = status(["algorithm.adv_estimator=grpo"], "zorro (critic)")
    assert s == "note" and "no critic in this run" in detail
    gae = ["algorithm.adv_estimator=gae"]
    s, detail = status(gae, "zorro (critic)")
    assert s == "ok" and "enabled" in detail and "strategy fsdp" in detail
    s, detail = status(gae + ["actor_rollout_ref.actor.fsdp_config.zorro.enable=false"], "zorro (critic)")
    assert s == "note" and "stock critic" in detail
    s, detail = status(gae + ["critic.strategy=megatron"], "zorro (critic)")
    assert s == "note" and "stock critic" in detail  # its megatron node has no zorro: verl's stock critic
    s, detail = status(gae + ["critic.loss_agg_mode=seq-mean-token-sum-norm"], "zorro (critic)")
    assert s == "FAIL" and "loss_scale_factor" in detail


def test_roles_line():
    """The ``roles`` line: each model verl runs over the rollouts (the doctor's ROLES table) as ``zorro``, ``stock``,
    ``refused`` or not in this run, with verl's rules for the reference (KL loss or KL reward) and the critic
    (``critic.enable``, else GAE)."""
    from zorro_verl.doctor import ROLES, run_checks

    assert [r.name for r in ROLES] == ["actor", "ref", "critic"]

    def roles(overrides):
        c = {c.name: c for c in run_checks(overrides, torch.device("cpu"), check_plugin=False)}["roles"]
        return c.status, dict(part.split(": ", 1) for part in c.detail.split("; "))

    kl, grpo, gae = ["actor_rollout_ref.actor.use_kl_loss=True"], ["algorithm.adv_estimator=grpo"], \
        ["algorithm.adv_estimator=gae"]
    assert roles(kl + gae) == ("ok", {"actor": "zorro", "ref": "zorro", "critic": "zorro"})
    s, r = roles(grpo)
    assert s == "ok" and r["actor"] == "zorro" and r["ref"].startswith("not in this run (")
    assert r["critic"] == "not in this run (algorithm.adv_estimator=grpo, critic.enable unset)"
    assert roles(grpo + ["critic.enable=true"])[1]["critic"] == "zorro"
    assert roles(gae + ["critic.enable=false"])[1]["critic"] == "not in this run (critic.enable=false)"
    assert roles(["algorithm.use_kl_in_reward=True"] + grpo)[1]["ref"] == "zorro"
    s, r = roles(kl + gae + ["actor_rollout_ref.actor.fsdp_config.zorro.enable=false"])
    assert s == "note" and r == {"actor": "stock", "ref": "stock", "critic": "stock"}  # ref and critic follow
    s, r = roles(kl + gae + ["critic.strategy=megatron"])  # a Megatron critic: verl's stock one
    assert s == "note" and (r["actor"], r["ref"], r["critic"]) == ("zorro", "zorro", "stock")
    s, r = roles(gae + ["critic.loss_agg_mode=seq-mean-token-sum-norm"])
    assert s == "note" and r["critic"] == "refused (see its line)" and r["actor"] == "zorro"


def test_backend_line_on_cuda(monkeypatch):
    """The attention-backend line on a CUDA device: ``auto -> flash_copyfree`` (ok) with flash kernels, saying why
    (the memory rule); without them ``sdpa`` as a note that names the extra memory and the fix."""
    from zorro_verl.attention.primitives import flash_provider
    from zorro_verl.doctor import _backend_checks

    cuda = torch.device("cuda")
    monkeypatch.setenv("ZORRO_FLASH_PROVIDER", "torch")
    line = _backend_checks(cuda)[0]
    assert line.status == "ok" and line.detail.startswith("auto -> flash_copyfree (flash kernels available (torch)")
    assert "no more for backward than stock's" in line.detail
    monkeypatch.delenv("ZORRO_FLASH_PROVIDER")
    if flash_provider() is None:
        line = _backend_checks(cuda)[0]
        assert line.status == "note" and line.detail.startswith("auto -> sdpa")
        assert "more memory than stock's" in line.detail and "zorro-verl[flash]" in line.detail


def test_trainer_balance_hooks_line(monkeypatch):
    """Whether the trainer process installs zorro's balancing hooks: through the entry point, or through the preset's
    external_lib; not in docs/verl-fsdp.md's overrides-only launch when VERL_USE_EXTERNAL_PLUGINS skips the entry
    point."""
    from tests.integrations.verl.v09.test_overrides import documented_overrides
    from zorro_verl.doctor import run_checks

    def line(overrides, config_name="zorro_ppo_trainer"):
        checks = run_checks(overrides, torch.device("cpu"), check_plugin=False, config_name=config_name)
        return next((c for c in checks if c.name == "trainer balance hooks"), None)

    monkeypatch.delenv("VERL_USE_EXTERNAL_PLUGINS", raising=False)
    assert "entry point" in line(documented_overrides(), "ppo_trainer").detail
    monkeypatch.setenv("VERL_USE_EXTERNAL_PLUGINS", "none")
    c = line(documented_overrides(), "ppo_trainer")
    assert c.status == "note", c
    assert "VERL_USE_EXTERNAL_PLUGINS='none'" in c.detail and "zorro/balance_hooks_missing" in c.detail
    assert "Fix: actor_rollout_ref.model.external_lib=zorro_verl.integrations.verl.v09.plugin" in c.detail
    c = line([])  # the preset names the plugin in external_lib
    assert c.status == "ok" and "external_lib" in c.detail
    assert line(["actor_rollout_ref.model.external_lib=null"]).status == "note"
    assert line(["actor_rollout_ref.actor.fsdp_config.zorro.group_balance=false",
                 "actor_rollout_ref.model.external_lib=null"]).status == "ok"
    assert line(["actor_rollout_ref.actor.fsdp_config.zorro.enable=false"]) is None
    with pytest.raises(ValueError, match="config_name: expected one of"):
        run_checks([], torch.device("cpu"), check_plugin=False, config_name="other")


MEGATRON_TARGET = "zorro_verl.integrations.verl.v09.config.ZorroMcoreEngineConfig"


def _megatron_checks(overrides, config_name="zorro_megatron_trainer"):
    from zorro_verl.doctor import run_checks

    return {c.name: c for c in run_checks(overrides, torch.device("cpu"), check_plugin=False, config_name=config_name)}


def test_megatron_preset_composes_and_zorro_lines_pass():
    """The Megatron preset composes (verl's ppo_trainer with model_engine=megatron) and the doctor reads the zorro
    node of actor and reference from their ``megatron`` node; the megatron-core line follows this environment."""
    import importlib.util

    checks = _megatron_checks([])
    for role in ("actor", "ref"):
        c = checks[f"zorro ({role})"]
        assert c.status == "ok" and "megatron TP 1" in c.detail, c
    assert checks["trainer balance hooks"].status == "ok"
    mcore, bridge = checks["megatron-core"], checks["megatron bridge"]
    if importlib.util.find_spec("megatron") is None:  # this venv: the run would not start, the fix is named
        assert mcore.status == "FAIL" and "bash scripts/setup_megatron_env.sh" in mcore.detail, mcore
        assert "megatron-core==0.19.2 --ignore-requires-python --no-deps" in mcore.detail
        # verl's default builder, Megatron-Bridge, is what the preset selects: its install line
        assert bridge.status == "FAIL" and "Megatron-Bridge selected by the actor and ref (vanilla_mbridge=false)" \
            in bridge.detail and "pip install megatron-bridge==0.6.2" in bridge.detail, bridge
        legacy = _megatron_checks(["actor_rollout_ref.actor.megatron.vanilla_mbridge=true",
                                   "actor_rollout_ref.ref.megatron.vanilla_mbridge=true"])["megatron bridge"]
        assert legacy.status == "FAIL" and "mbridge selected" in legacy.detail \
            and "pip install mbridge==0.15.1" in legacy.detail, legacy
    else:
        assert mcore.status == "ok", mcore
    for role in ("actor", "ref"):  # verl turns sequence parallelism off at TP = 1: the line says what runs
        assert "sequence parallel False" in checks[f"zorro ({role})"].detail
        assert "built by Megatron-Bridge" in checks[f"zorro ({role})"].detail
    assert "megatron-core" not in _megatron_checks([], "zorro_ppo_trainer")  # an FSDP config: no such line


@pytest.mark.parametrize("override, words", [
    ("actor_rollout_ref.actor.megatron.dynamic_context_parallel=true", "dynamic context parallelism"),
    ("actor_rollout_ref.model.lora.rank=8 actor_rollout_ref.model.lora.dropout=0.1", "model.lora.dropout=0"),
    ("actor_rollout_ref.actor.megatron.zorro.logits_optimization=memory", "logits_optimization=memory"),
])
def test_megatron_refusals_fail_and_say_why(override, words):
    """What the zorro Megatron engine refuses at start FAILs in the doctor, for the actor and (it reads the actor's
    parallel layout and the shared model config) the reference."""
    checks = _megatron_checks(override.split())
    for role in ("actor", "ref"):
        c = checks[f"zorro ({role})"]
        assert c.status == "FAIL" and words in c.detail, c
    warn = _megatron_checks([*override.split(), "actor_rollout_ref.actor.megatron.zorro.on_unsupported=warn"])
    assert warn["zorro (actor)"].status == "note" and "zorro/fallback_batches" in warn["zorro (actor)"].detail


def test_megatron_static_context_parallel_ok():
    """Static context parallelism runs on the zorro Megatron actor and reference (the ref reads the actor's layout):
    no FAIL, and the line says the CP size."""
    checks = _megatron_checks(["actor_rollout_ref.actor.megatron.context_parallel_size=2"])
    for role in ("actor", "ref"):
        c = checks[f"zorro ({role})"]
        assert c.status == "ok" and "CP 2" in c.detail, c


def test_megatron_virtual_pipeline_and_fused_kernels_ok():
    """Virtual pipeline stages and verl's fused kernels run on the zorro Megatron engine: no FAIL."""
    checks = _megatron_checks(["actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2",
                               "actor_rollout_ref.model.use_fused_kernels=true"])
    for role in ("actor", "ref"):
        assert checks[f"zorro ({role})"].status == "ok", checks[f"zorro ({role})"]


def test_megatron_disabled_and_overrides_only_launch():
    checks = _megatron_checks(["actor_rollout_ref.actor.megatron.zorro.enable=false"])
    assert checks["zorro (actor)"].status == "note" and "disabled" in checks["zorro (actor)"].detail
    assert checks["zorro (ref)"].status == "note"  # the ref's enable follows the actor's
    assert "trainer balance hooks" not in checks
    # verl's own config with model_engine=megatron and the zorro node added by overrides only
    overrides = ["model_engine=megatron", f"actor_rollout_ref.actor.megatron._target_={MEGATRON_TARGET}",
                 "+actor_rollout_ref.actor.megatron.zorro.enable=true",
                 f"actor_rollout_ref.ref.megatron._target_={MEGATRON_TARGET}",
                 "+actor_rollout_ref.ref.megatron.zorro.enable=true"]
    checks = _megatron_checks(overrides, "ppo_trainer")
    assert checks["zorro (actor)"].status == "ok" and checks["zorro (ref)"].status == "ok"
    assert "megatron-core" in checks
    assert _megatron_checks(overrides + ["actor_rollout_ref.actor.megatron.dynamic_context_parallel=true"],
                            "ppo_trainer")["zorro (actor)"].status == "FAIL"
    # without the zorro node, verl's Megatron config runs the stock engine
    assert _megatron_checks(["model_engine=megatron"], "ppo_trainer")["zorro (actor)"].status == "note"
    # the FSDP preset's zorro node under a Megatron strategy: named, not silently disabled
    c = _megatron_checks(["actor_rollout_ref.actor.strategy=megatron"], "zorro_ppo_trainer")["zorro (actor)"]
    assert c.status == "FAIL" and "zorro_megatron_trainer" in c.detail


def test_megatron_cli_exit_code_and_balance_hooks_node(monkeypatch):
    """The CLI accepts the Megatron preset; the balance-hooks line reads the actor's megatron node."""
    import importlib.util

    out = _doctor("--config-name", "zorro_megatron_trainer", "--device", "cpu")
    assert " ok " in _line(out.stdout, "zorro (actor)"), out.stdout + out.stderr
    assert out.returncode == (1 if importlib.util.find_spec("megatron") is None else 0), out.stdout
    monkeypatch.setenv("VERL_USE_EXTERNAL_PLUGINS", "none")
    hooks = _megatron_checks(["actor_rollout_ref.model.external_lib=null"])["trainer balance hooks"]
    assert hooks.status == "note" and "actor_rollout_ref.model.external_lib" in hooks.detail
    assert _megatron_checks(["actor_rollout_ref.model.external_lib=null",
                             "actor_rollout_ref.actor.megatron.zorro.group_balance=false"])[
        "trainer balance hooks"].status == "ok"


def test_documented_megatron_overrides_only_block():
    """docs/verl-megatron.md's overrides-only lines, on verl's own ppo_trainer: zorro enabled in both megatron nodes."""
    import re

    from tests.support import REPO_ROOT

    text = (REPO_ROOT / "docs" / "verl-megatron.md").read_text()
    block = re.search(r"<!-- zorro-megatron-overrides -->\s*```bash\n(.*?)```", text, re.S)
    assert block, "docs/verl-megatron.md lost its Megatron overrides-only block"
    overrides = [tok for tok in block.group(1).split() if "=" in tok and not tok.startswith("--")]
    assert "model_engine=megatron" in overrides and len(overrides) == 5
    checks = _megatron_checks(overrides, "ppo_trainer")
    assert checks["zorro (actor)"].status == "ok" and checks["zorro (ref)"].status == "ok"


def test_megatron_critic_line_and_documented_critic_overrides():
    """The Megatron preset's critic (``critic.megatron.zorro`` follows the actor's switch) and docs/verl-megatron.md's
    critic overrides-only lines on verl's own ppo_trainer: the doctor's critic line reads the critic's megatron node
    (its parallel layout, builder and the Megatron engine's start-time refusals)."""
    import re

    from tests.support import REPO_ROOT

    gae = ["algorithm.adv_estimator=gae"]
    c = _megatron_checks(gae)["zorro (critic)"]
    assert c.status == "ok" and "strategy megatron" in c.detail and "megatron TP 1" in c.detail, c
    assert "built by Megatron-Bridge" in c.detail, c
    off = _megatron_checks(gae + ["actor_rollout_ref.actor.megatron.zorro.enable=false"])["zorro (critic)"]
    assert off.status == "note" and "stock critic" in off.detail, off
    cp = _megatron_checks(gae + ["critic.megatron.dynamic_context_parallel=true"])["zorro (critic)"]
    assert cp.status == "FAIL" and "dynamic context parallelism" in cp.detail, cp
    warn = _megatron_checks(gae + ["critic.megatron.dynamic_context_parallel=true",
                                   "actor_rollout_ref.actor.megatron.zorro.on_unsupported=warn"])["zorro (critic)"]
    assert warn.status == "note", warn
    static = _megatron_checks(gae + ["critic.megatron.context_parallel_size=2"])["zorro (critic)"]
    assert static.status == "ok" and "CP 2" in static.detail, static  # static CP runs on the critic
    text = (REPO_ROOT / "docs" / "verl-megatron.md").read_text()
    block = re.search(r"<!-- zorro-megatron-critic-overrides -->\s*```bash\n(.*?)```", text, re.S)
    assert block, "docs/verl-megatron.md lost its critic overrides block"
    overrides = [tok for tok in block.group(1).split() if "=" in tok and not tok.startswith("--")]
    assert len(overrides) == 4
    checks = _megatron_checks(overrides, "ppo_trainer")
    assert checks["zorro (critic)"].status == "ok" and "strategy megatron" in checks["zorro (critic)"].detail
    assert "megatron-core" in checks
    # without the critic's zorro node, verl's Megatron critic is the stock one
    assert _megatron_checks(overrides[:2], "ppo_trainer")["zorro (critic)"].status == "note"
