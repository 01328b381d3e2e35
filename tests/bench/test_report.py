"""The target checks (thresholds from the preset) and the table of both kinds of rows."""

import dataclasses

from zorro_verl.bench import PRESETS, check_targets, format_table
from zorro_verl.bench.presets import Targets

BASE = {"mode": "fwd_bwd", "baseline": "a2a", "backend": "sdpa", "scenario": "s", "R": 32}


def _rows():
    # targets are judged on the paired estimates; the ratio-of-medians fields deliberately disagree here
    return [
        dict(BASE, B=8, G=2, P=256, n=4.0, efficiency=0.5, efficiency_paired=0.9, speedup=1.0,
             speedup_paired=2.5),  # P/R 8, n 4: checked, pass
        dict(BASE, B=8, G=2, P=256, n=4.0, efficiency=0.95, efficiency_paired=0.8, speedup=2.6,
             speedup_paired=2.2),  # checked, fail
        dict(BASE, B=8, G=4, P=256, n=2.0, efficiency=0.5, efficiency_paired=0.5, speedup=1.0,
             speedup_paired=1.0),  # n = 2: not a target
        dict(BASE, B=8, G=8, P=256, n=1.0, efficiency=0.9, efficiency_paired=0.96, speedup=0.9,
             speedup_paired=0.96),  # no sharing, within 5%
        dict(BASE, B=8, G=8, P=256, n=1.0, efficiency=0.96, efficiency_paired=0.9, speedup=0.96,
             speedup_paired=0.9),  # no sharing, > 5% slower
        {"mode": "plan", "scenario": "p", "B": 512, "G": 64, "plan_fraction": 0.01},
    ]


def test_check_targets():
    out = check_targets(_rows(), PRESETS["cpu-quick"].targets)
    assert [line.split()[0] for line in out] == ["PASS", "FAIL", "PASS", "FAIL", "PASS"]
    assert "<= 1.05" in out[2] and ">= 0.85" in out[0] and "<= 2% of a fwd_bwd step" in out[4]


def test_thresholds_come_from_the_preset():
    cpu = PRESETS["cpu-quick"].targets
    assert (cpu.efficiency, cpu.efficiency_min_pr, cpu.efficiency_min_n, cpu.noshare_time, cpu.plan_fraction) == \
        (0.85, 4.0, 4.0, 1.05, 0.02)
    # looser thresholds flip the failing rows; a tighter plan fraction fails the plan row
    loose = dataclasses.replace(cpu, efficiency=0.75, noshare_time=1.2, plan_fraction=0.005)
    out = check_targets(_rows(), loose)
    assert [line.split()[0] for line in out] == ["PASS", "PASS", "PASS", "PASS", "FAIL"]
    assert ">= 0.75" in out[0] and "<= 1.2 " in out[3] and "<= 0.5% of" in out[4]
    # n >= 2 brings the n = 2 row under the efficiency target; checks switched off give no line
    wide = Targets(efficiency=0.85, efficiency_min_n=2.0)
    assert [line.split()[0] for line in check_targets(_rows(), wide)] == ["PASS", "FAIL", "FAIL"]
    assert check_targets(_rows(), None) == [] and check_targets(_rows(), Targets()) == []
    assert PRESETS["cpu-full"].targets is None


def test_gpu_target_only_on_its_shape():
    gpu = PRESETS["gpu"].targets
    rows = [dict(BASE, B=8, G=2, P=4096, R=512, n=4.0, efficiency=0.9, efficiency_paired=0.9, speedup=2.5,
                 speedup_paired=2.5),
            dict(BASE, B=16, G=1, P=8192, R=1024, n=16.0, efficiency=0.5, efficiency_paired=0.5, speedup=2.0,
                 speedup_paired=2.0),  # not the target's shape
            dict(BASE, B=8, G=8, P=256, n=1.0, efficiency=0.5, efficiency_paired=0.5, speedup=0.5,
                 speedup_paired=0.5),  # no CPU no-sharing target on the gpu preset
            {"mode": "plan", "scenario": "p", "B": 512, "G": 64, "plan_fraction": 0.5}]
    out = check_targets(rows, gpu)
    assert len(out) == 1 and out[0].startswith("PASS efficiency 0.900 >= 0.85") and "(s, P/R=8, n=4" in out[0]


def test_ops_rows_have_no_targets_and_their_own_table():
    row = {"bench": "ops", "scenario": "s", "B": 8, "G": 8, "P": 256, "R": 32, "mode": "fwd_bwd",
           "backend": "sdpa", "baseline": "ordinary", "ms": 2.0, "ordinary_ms": 1.0, "ratio": 2.0,
           "ratio_paired": 2.0, "ideal_speedup": 1.0, "efficiency": 0.5, "peak_mb": 1.0, "ordinary_peak_mb": 1.0,
           "max_abs_diff": 0.0}
    assert check_targets([row], PRESETS["cpu-quick"].targets) == []
    table = format_table([row])
    assert table.startswith("attention op") and "ordinary" in table and "base ms" not in table
    model_row = dict(_rows()[0], baseline_ms=3.0, zorro_ms=1.0, ideal_speedup=3.0, baseline_peak_mb=1.0,
                     zorro_peak_mb=1.0)
    lines = format_table([model_row, row]).splitlines()
    assert lines[0].split()[:2] == ["scenario", "B"] and "base ms" in lines[0]  # model rows first, as before
    assert lines[2] == "" and lines[3].startswith("attention op") and len(lines) == 6
