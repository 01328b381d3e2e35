"""``zorro-verl doctor``: the command users run before a zorro-enabled verl job (real subprocesses of the CLI)."""

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("verl")


def _doctor(*args, **env):
    return subprocess.run([sys.executable, "-m", "zorro_verl.cli", "doctor", *args], capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, **env))


def _line(out: str, name: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(name))


def test_ready_setup_reports_versions_plugin_backend_and_exits_0():
    out = _doctor()
    assert out.returncode == 0, out.stdout + out.stderr
    for name in ("torch", "transformers", "verl", "flash-attn", "flash-linear-attention", "causal-conv1d", "vLLM"):
        assert _line(out.stdout, name)
    assert " ok " in _line(out.stdout, "verl plugin")
    assert "auto -> sdpa" in _line(out.stdout, "attention backend")  # this CPU host
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


def test_trainer_balance_hooks_line(monkeypatch):
    """Whether the trainer process installs zorro's balancing hooks: through the entry point, or through the preset's
    external_lib; not in the README's overrides-only launch when VERL_USE_EXTERNAL_PLUGINS skips the entry point."""
    from tests.integrations.verl.v09.test_overrides import readme_overrides
    from zorro_verl.doctor import run_checks

    def line(overrides, config_name="zorro_ppo_trainer"):
        checks = run_checks(overrides, torch.device("cpu"), check_plugin=False, config_name=config_name)
        return next((c for c in checks if c.name == "trainer balance hooks"), None)

    monkeypatch.delenv("VERL_USE_EXTERNAL_PLUGINS", raising=False)
    assert "entry point" in line(readme_overrides(), "ppo_trainer").detail
    monkeypatch.setenv("VERL_USE_EXTERNAL_PLUGINS", "none")
    c = line(readme_overrides(), "ppo_trainer")
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
