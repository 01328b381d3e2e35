"""The Megatron benchmark (``python -m zorro_verl.bench --megatron``) at a tiny size: every field of its rows finite
and positive, zorro's per-token log-probs equal to megatron's ordinary forward's inside the run (fp32, 1e-5), the
FLOP model's token counts, the targets' lines, the table, and the command line (its CPU setup hook imported from
this checkout's tests/support). Runs in ``.venv-megatron`` (scripts/test_megatron.sh)."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed here (run scripts/test_megatron.sh: "
                                            ".venv-megatron)")

import torch  # noqa: E402

from zorro_verl.bench.megatron import (  # noqa: E402
    MegatronScenario,
    check_megatron_targets,
    flop_config,
    format_megatron_table,
    megatron_batches,
    megatron_setup,
    run_megatron_bench,
)

POSITIVE = ("ordinary_ms", "zorro_ms", "plan_ms", "plan_fraction", "speedup", "speedup_paired", "ideal_speedup",
            "efficiency_paired", "ideal_response_head", "ordinary_tokens", "zorro_tokens", "response_tokens",
            "flops_ordinary", "flops_zorro")


def test_megatron_bench_tiny():
    scs = (MegatronScenario("share", 6, 2, 12, 2, 5), MegatronScenario("none", 3, 3, 10, 1, 4))
    rows = run_megatron_bench(scs, setup=megatron_setup("cpu"), modes=("fwd", "fwd_bwd"),
                              dtypes=(torch.float32,), model_shape="tiny", reps=5, warmup=1,
                              log=lambda *a: None)
    assert [(r["dtype"], r["scenario"], r["mode"]) for r in rows] == [
        (str(torch.float32), s.name, m) for s in scs for m in ("fwd", "fwd_bwd")]
    vocab = flop_config("tiny").vocab_size
    for r in rows:
        for key in POSITIVE:
            assert math.isfinite(r[key]) and r[key] > 0, (key, r[key])
        assert len(r["zorro_runs_ms"]) == len(r["ordinary_runs_ms"]) == 5
        assert r["zorro_ms"] == pytest.approx(sorted(r["zorro_runs_ms"])[2])
        assert r["efficiency_paired"] == pytest.approx(r["speedup_paired"] / r["ideal_speedup"])
        assert r["mem_method"] in ("rss_hwm", "none") and r["versions"]["megatron_core"]
        # the head on every row of the ordinary side weighs more than a response-only head would
        assert r["ideal_speedup"] >= r["ideal_response_head"]
        assert r["logprob_max_abs_diff"] <= 1e-5
        sc = scs[0] if r["scenario"] == "share" else scs[1]
        if sc.G == sc.B:
            assert r["ideal_speedup"] > 1  # nothing shared: only the padding and the head on every row
        # token counts: the mean over the timed runs' batches (runs 1..5 take batches 1, 2, 0, 1, 2)
        bts = megatron_batches(sc, 3, vocab, "cpu")
        used = [bts[i % 3] for i in range(1, 6)]
        assert r["ordinary_tokens"] == round(sum(b["stock_ids"].numel() for b in used) / 5)
        unique = [sum(int(b["p_len"][b["group"] == g][0]) for g in range(sc.G)) + int(b["r_len"].sum())
                  for b in used]
        assert r["zorro_tokens"] == round(sum(unique) / 5)
    assert rows[0]["ideal_speedup"] > rows[2]["ideal_speedup"]  # sharing 3 rollouts a prompt vs none
    checks = check_megatron_targets(rows)
    assert sum(c.startswith("PASS") and "log-probs" in c for c in checks) == 2  # fp32, once per scenario
    assert any(c.startswith("INFO none: zorro / ordinary time") for c in checks)
    table = format_megatron_table(rows)
    assert table.count("\n") == len(rows) + 1 and "| float32 | share | 6 | 3 | 10..12 | 2..5 | fwd |" in table


def test_megatron_bench_command_line_bf16(tmp_path, capsys):
    """The command line end to end, in bf16 (reported, not judged: exit code 0 whatever its numbers)."""
    from zorro_verl.bench.cli import main

    out = tmp_path / "rows.json"
    rc = main(["--megatron", "--model", "tiny", "--megatron-scenario", "4,2,8,1,3", "--dtype", "bfloat16",
               "--modes", "fwd", "--json", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())
    assert len(rows) == 1 and rows[0]["bench"] == "megatron" and rows[0]["scenario"] == "B4G2-P8-R1..3"
    assert rows[0]["dtype"] == "torch.bfloat16" and rows[0]["threads"] == 1
    # bf16 kernels round differently on the two sides; a wrong row or position would differ by O(1)
    assert 0 <= rows[0]["logprob_max_abs_diff"] < 0.1
    assert "INFO B4G2-P8-R1..3: log-probs max" in capsys.readouterr().out
