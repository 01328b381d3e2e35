"""Presets and the command line: explicit settings (no device detection), flags override fields, --quick is
--preset cpu-quick."""

import pytest

from zorro_verl.bench import PRESETS
from zorro_verl.bench.cli import settings
from zorro_verl.bench.presets import CPU_FULL_EXTRA, GPU_SCENARIOS, QUICK_PLAN_SCENARIO, QUICK_SCENARIOS


def test_preset_fields():
    q, f, g = PRESETS["cpu-quick"], PRESETS["cpu-full"], PRESETS["gpu"]
    assert (q.device, q.dtype, q.model, q.clock, q.threads, q.grad_ckpt) == ("cpu", "float32", "quick", "cpu", 1,
                                                                           False)
    assert q.scenarios == QUICK_SCENARIOS and q.plan_scenario == QUICK_PLAN_SCENARIO
    assert (QUICK_PLAN_SCENARIO.B, QUICK_PLAN_SCENARIO.G) == (512, 64)
    assert [(s.B, s.G, s.P, s.R, s.ragged) for s in QUICK_SCENARIOS] == [
        (8, 2, 256, 32, False), (8, 1, 256, 32, False), (8, 2, 256, 64, False), (8, 2, 256, 32, True),
        (8, 8, 256, 32, False)]
    assert f.scenarios == QUICK_SCENARIOS + CPU_FULL_EXTRA and f.targets is None and f.plan_scenario is None
    assert (g.device, g.dtype, g.model, g.clock, g.grad_ckpt) == ("cuda", "bfloat16", "qwen3-0.6b", "wall", True)
    assert g.scenarios == GPU_SCENARIOS and g.backends is None
    assert g.targets.efficiency == 0.85 and g.targets.efficiency_shapes == ((8, 2, 4096, 512),)
    assert g.targets.noshare_time is None and g.targets.plan_fraction is None


def test_quick_is_preset_cpu_quick_and_the_default():
    assert settings(["--quick"]) == settings(["--preset", "cpu-quick"]) == PRESETS["cpu-quick"]
    assert settings([]) == PRESETS["cpu-quick"]  # no device detection
    assert settings(["--quick", "--reps", "7"]) == PRESETS["cpu-quick"]
    with pytest.raises(ValueError, match="--quick"):
        settings(["--quick", "--preset", "gpu"])


def test_flags_override_preset_fields():
    s = settings(["--preset", "gpu", "--dtype", "float32", "--model", "quick", "--scenario", "4,1,12,4",
                  "--clock", "cpu", "--no-grad-ckpt", "--backends", "sdpa, eager"])
    assert (s.device, s.dtype, s.model, s.clock, s.grad_ckpt, s.backends) == ("cuda", "float32", "quick", "cpu",
                                                                              False, ("sdpa", "eager"))
    assert [(x.B, x.G, x.P, x.R) for x in s.scenarios] == [(4, 1, 12, 4)]
    assert s.targets == PRESETS["gpu"].targets  # same device type: the preset's targets stay
    q = settings(["--preset", "cpu-quick", "--threads", "2", "--grad-ckpt", "--scenario", "8,8,16,4"])
    assert (q.threads, q.grad_ckpt, q.targets, q.plan_scenario) == (2, True, PRESETS["cpu-quick"].targets,
                                                                    QUICK_PLAN_SCENARIO)
    with pytest.raises(ValueError, match="--dtype"):
        settings(["--dtype", "int8"])


def test_device_override_keeps_the_preset_but_drops_its_targets():
    s = settings(["--device", "cuda"])  # no preset: cpu-quick's scenarios and settings, on cuda
    assert s.scenarios == QUICK_SCENARIOS and (s.device, s.dtype, s.model) == ("cuda", "float32", "quick")
    assert s.targets is None  # the CPU targets are claims about the CPU
    assert settings(["--preset", "gpu", "--device", "cpu"]).targets is None


def test_ad_hoc_grid_without_preset_has_no_checks_unless_plan_check():
    s = settings(["--scenario", "4,1,12,4"])
    assert s.targets is None and s.plan_scenario is None and s.backends == ("sdpa",)
    p = settings(["--scenario", "4,1,12,4", "--plan-check"])
    assert p.targets == PRESETS["cpu-quick"].targets and p.plan_scenario == QUICK_PLAN_SCENARIO
    f = settings(["--preset", "cpu-full", "--plan-check"])
    assert f.plan_scenario == QUICK_PLAN_SCENARIO and f.targets is None
