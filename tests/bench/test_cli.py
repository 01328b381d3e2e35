"""The command line end to end on a tiny grid (rows, JSON, plot) and its argument errors."""

import json
import subprocess
import sys

import pytest

from tests.support import HANG_TIMEOUT_S
from zorro_verl import bench


def test_reps_below_five_refused():
    with pytest.raises(ValueError, match="--reps"):
        bench.main(["--scenario", "2,1,4,2", "--reps", "3"])
    with pytest.raises(ValueError, match="--reps"):
        bench.main(["--ops", "--scenario", "2,1,4,2", "--reps", "3"])


def test_bad_flags_refused():
    with pytest.raises(ValueError, match="--modes"):
        bench.main(["--scenario", "2,1,4,2", "--modes", "bwd"])
    with pytest.raises(ValueError, match="--backends"):
        bench.main(["--scenario", "2,1,4,2", "--backends", "nope"])
    with pytest.raises(ValueError, match="--plot"):
        bench.main(["--ops", "--scenario", "2,1,4,2", "--plot", "x.png"])


def test_cli_end_to_end_rows_json_plot(tmp_path, capsys):
    js, png = tmp_path / "rows.json", tmp_path / "plot.png"
    rc = bench.main(["--scenario", "4,1,12,4", "--scenario", "4,4,12,4,ragged", "--reps", "5", "--json", str(js),
                     "--plot", str(png)])
    assert rc == 0
    rows = json.loads(js.read_text())
    assert len(rows) == 2 * 2 * 2  # scenarios x modes x baselines (one backend: sdpa, cpu-quick's)
    required = {"scenario", "B", "G", "P", "R", "mode", "backend", "baseline", "baseline_ms", "zorro_ms", "speedup",
                "ideal_speedup", "efficiency", "baseline_peak_mb", "zorro_peak_mb", "device", "versions", "git_sha"}
    for r in rows:
        assert required <= set(r)
        assert len(r["zorro_runs_ms"]) == 5 and len(r["baseline_runs_ms"]) == 5
        assert r["zorro_ms"] == pytest.approx(sorted(r["zorro_runs_ms"])[2])  # the median of 5
        assert r["speedup"] == pytest.approx(r["baseline_ms"] / r["zorro_ms"])
        assert r["efficiency"] == pytest.approx(r["speedup"] / r["ideal_speedup"])
        pairs = sorted(b / z for b, z in zip(r["baseline_runs_ms"], r["zorro_runs_ms"]))
        assert r["speedup_paired"] == pytest.approx(pairs[2])  # median of the 5 neighbouring-run ratios
        assert r["efficiency_paired"] == pytest.approx(r["speedup_paired"] / r["ideal_speedup"])
        assert r["logprob_sum_rel_diff"] < 1e-5  # fp32: zorro and the ordinary forward agree
    assert {r["mode"] for r in rows} == {"fwd", "fwd_bwd"} and {r["baseline"] for r in rows} == {"a2a", "full"}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "speedup" in out and "PASS" not in out and "FAIL" not in out  # ad-hoc grid: no target checks


def test_python_dash_m_entry_point():
    out = subprocess.run([sys.executable, "-m", "zorro_verl.bench", "--help"], capture_output=True, text=True,
                         timeout=HANG_TIMEOUT_S)
    assert out.returncode == 0 and "--preset" in out.stdout and "--ops" in out.stdout
    from zorro_verl.cli import main as cli_main

    assert cli_main(["bench", "--scenario", "2,1,4,2", "--reps", "5", "--modes", "fwd", "--no-full",
                     "--ops"]) == 0


def test_lora_rows(tmp_path):
    """``--lora 4``: LoRA training rows (PEFT adapters on every linear layer but the head, base frozen), their ideal
    from the LoRA FLOP terms; zorro's log-probs equal the ordinary forward's with the adapters in (fp32)."""
    js = tmp_path / "rows.json"
    assert bench.main(["--scenario", "4,1,12,4", "--reps", "5", "--no-full", "--lora", "4", "--json", str(js)]) == 0
    rows = json.loads(js.read_text())
    assert len(rows) == 2 and {r["mode"] for r in rows} == {"fwd", "fwd_bwd"}
    for r in rows:
        assert r["lora_rank"] == 4 and r["scenario"] == "4x1x12x4+lora4"
        assert r["logprob_sum_rel_diff"] < 1e-5 and r["ideal_speedup"] > 1.0
    with pytest.raises(ValueError, match="--lora"):
        bench.main(["--scenario", "2,1,4,2", "--lora", "-1"])
