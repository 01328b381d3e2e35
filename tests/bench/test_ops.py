"""The op-level attention benchmark: every CPU backend's split attention equals the ordinary per-row SDPA on valid
tokens (fp64), rows carry their keys, and the command line runs it."""

import json

import pytest
import torch

from zorro_verl.bench import Scenario, run_ops
from zorro_verl.bench.ops import make_op_inputs, ordinary_attention, packed_view, zorro_attention
from zorro_verl.bench.runner import make_batches
from zorro_verl.testing import create_dummy_batch

ROW_KEYS = {"bench", "scenario", "B", "G", "P", "R", "n", "ragged", "T", "S", "Hq", "Hkv", "D", "mode", "backend",
            "baseline", "ms", "ordinary_ms", "ratio", "ratio_paired", "speedup", "ideal_speedup", "efficiency",
            "peak_mb", "ordinary_peak_mb", "mem_method", "runs_ms", "ordinary_runs_ms", "max_abs_diff", "device",
            "versions", "git_sha", "dtype", "model", "clock", "reps", "warmup", "threads"}


def _cpu_backends():
    from zorro_verl.attention.registry import available_backends

    return available_backends(torch.device("cpu"))


@pytest.mark.parametrize("ragged,shuffle,G", [(False, False, 2), (True, True, 2), (True, False, 6)])
def test_every_cpu_backend_equals_ordinary_attention_fp64(ragged, shuffle, G):
    b = create_dummy_batch(6, G, 12, 5, device="cpu", add_padding=ragged, shuffle=shuffle, seed=3)
    x = make_op_inputs(b, 4, 2, 8, torch.float64, seed=0)
    assert (x.mask is None) == (not ragged)  # no padding: no mask, SDPA's is_causal, as the stock forward
    with torch.no_grad():
        ref = ordinary_attention(x, 8 ** -0.5)
        assert ref.shape == (6, b["input_ids"].shape[1], 4, 8)
        for be in _cpu_backends():
            got = zorro_attention(x, be, 8 ** -0.5)
            assert got.shape == (1, x.plan.T, 4, 8)
            a, z = packed_view(x, ref, got)
            assert a.shape[0] == int(b["attention_mask"].sum())  # every valid token of every row
            assert (a - z).abs().max() <= 1e-12, be


def test_padded_layout_holds_each_rows_tokens():
    b = create_dummy_batch(4, 2, 6, 3, device="cpu", add_padding=True, seed=1)
    x = make_op_inputs(b, 2, 1, 4, torch.float64, seed=0)
    valid = b["attention_mask"].bool()
    assert torch.equal(x.valid, valid)
    assert torch.equal(x.q_pad.permute(0, 2, 1, 3)[valid], x.q[0].transpose(0, 1)[x.index[valid]])
    assert (x.k_pad.permute(0, 2, 1, 3)[~valid] == 0).all()
    assert all(t.is_leaf and t.requires_grad for t in x.leaves())


def test_run_ops_tiny_scenario_rows():
    backends = _cpu_backends()
    scs = [Scenario("t", 4, 2, 12, 4), Scenario("tr", 4, 1, 12, 4, ragged=True)]
    rows = run_ops(scs, model_shape="quick", dtype=torch.float64, reps=5, log=lambda *a: None)
    assert len(rows) == 2 * 2 * len(backends)  # scenarios x modes x backends
    assert {r["backend"] for r in rows} == set(backends) and {r["mode"] for r in rows} == {"fwd", "fwd_bwd"}
    for r in rows:
        assert ROW_KEYS <= set(r) and r["bench"] == "ops" and r["baseline"] == "ordinary"
        assert (r["Hq"], r["Hkv"], r["D"]) == (4, 2, 64)  # the quick model shape's heads
        assert len(r["runs_ms"]) == 5 and len(r["ordinary_runs_ms"]) == 5
        assert r["ms"] == pytest.approx(sorted(r["runs_ms"])[2]) and r["ratio"] == pytest.approx(r["ms"] /
                                                                                               r["ordinary_ms"])
        pairs = sorted(z / o for z, o in zip(r["runs_ms"], r["ordinary_runs_ms"]))
        assert r["ratio_paired"] == pytest.approx(pairs[2])
        assert r["efficiency"] == pytest.approx(r["speedup"] / r["ideal_speedup"])
        assert r["max_abs_diff"] <= 1e-12  # fp64: compared before timing
    assert rows[0]["ideal_speedup"] > 1  # G < B: fewer attended pairs than the padded rows


def test_ideal_is_pairs_ratio_of_the_batches():
    from zorro_verl.bench.flops import attention_pairs

    sc = Scenario("u", 4, 1, 12, 4)
    b = make_batches(sc, 1, "cpu")[0]
    x = make_op_inputs(b, 4, 2, 64, torch.float32, seed=0)
    base, z = attention_pairs(x.plan.row_prompt_lens, x.plan.response_lens, x.plan.row_group, 16)
    assert (base, z) == (4 * 16 * 17 // 2, 12 * 13 // 2 + 4 * (4 * 12 + 10))
    row = run_ops([sc], modes=("fwd",), backends=["sdpa"], reps=5, log=lambda *a: None)[0]
    assert row["ideal_speedup"] == pytest.approx(base / z)


def test_cli_ops_json_and_table(tmp_path, capsys):
    from zorro_verl import bench

    js = tmp_path / "ops.json"
    rc = bench.main(["--ops", "--preset", "cpu-quick", "--scenario", "4,2,12,4,ragged", "--modes", "fwd_bwd",
                     "--json", str(js)])
    assert rc == 0
    rows = json.loads(js.read_text())
    assert len(rows) == len(_cpu_backends()) and all(ROW_KEYS <= set(r) for r in rows)
    assert all(r["dtype"] == "torch.float32" and r["max_abs_diff"] < 1e-5 for r in rows)
    out = capsys.readouterr().out
    assert "attention op" in out and "PASS" not in out and "FAIL" not in out  # no targets on op rows
