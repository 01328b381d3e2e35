"""The benchmark harness: its FLOP model against brute-force counts, the CLI end to end on a tiny grid (rows, JSON,
plot), the target checks and argument errors."""

import json

import pytest
import torch

from zorro_verl import bench
from zorro_verl.packing import build_plan
from zorro_verl.testing import create_dummy_batch


def _config():
    from transformers import Qwen3Config

    return Qwen3Config(**bench.MODEL_SHAPES["quick"])


def test_linear_flops_per_token_equal_twice_the_linear_weights_of_a_layer():
    from transformers import AutoModelForCausalLM

    cfg = _config()
    cfg.num_hidden_layers = 1
    model = AutoModelForCausalLM.from_config(cfg)
    layer = model.model.layers[0]
    weights = sum(m.weight.numel() for m in layer.modules() if isinstance(m, torch.nn.Linear))
    assert bench._linear_flops_per_token(cfg) == 2 * weights


@pytest.mark.parametrize("ragged,shuffle", [(False, False), (True, True)])
def test_flop_model_counts_tokens_and_attended_pairs(ragged, shuffle):
    """zorro's pairs = ones in the plan's dense [T, T] mask; baseline pairs = causal pairs of every padded row."""
    cfg = _config()
    b = create_dummy_batch(6, 2, 12, 5, device="cpu", add_padding=ragged, shuffle=shuffle, seed=4)
    plan = build_plan(b["input_ids"], b["attention_mask"], 5)
    S = b["input_ids"].shape[1]
    fl = bench.flop_model(cfg, plan.row_prompt_lens, plan.response_lens, plan.row_group, S)
    L, H, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
    per_pair = 4 * cfg.num_attention_heads * cfg.head_dim
    lin = bench._linear_flops_per_token(cfg)
    z_pairs = int(plan.dense_mask().sum())
    base_pairs = 6 * int(torch.ones(S, S).tril().sum())
    head = 2 * H * V * plan.N
    assert fl["zorro_tokens"] == plan.T and fl["N"] == plan.N
    assert fl["zorro"] == L * (lin * plan.T + per_pair * z_pairs) + head
    assert fl["baseline"] == L * (lin * 6 * S + per_pair * base_pairs) + head
    assert fl["baseline_full"] == fl["baseline"] - head + 2 * H * V * 6 * S


def test_linear_part_of_the_ideal_matches_design_examples():
    """DESIGN §1: linear ideal B(P+R) / (G P + B R) — the token counts of the FLOP model reproduce it."""
    for (B, G, P, R), expect in (((8, 2, 4096, 512), 3.0), ((16, 1, 8192, 1024), 6.0), ((16, 4, 8192, 1024), 3.0),
                                 ((16, 16, 8192, 1024), 1.0)):
        row_group = torch.arange(B) * G // B
        fl = bench.flop_model(_config(), torch.full((B,), P), torch.full((B,), R), row_group, P + R)
        assert fl["baseline_tokens"] / fl["zorro_tokens"] == pytest.approx(expect, rel=1e-12)


def test_parse_scenario():
    assert bench.parse_scenario("8,2,64,16") == bench.Scenario("8x2x64x16", 8, 2, 64, 16, False)
    assert bench.parse_scenario("8,2,64,16,ragged").ragged
    for bad in ("8,2,64", "8,9,64,16", "8,2,64,16,odd", "a,b,c,d"):
        with pytest.raises(ValueError, match="--scenario"):
            bench.parse_scenario(bad)


def test_reps_below_five_refused():
    with pytest.raises(ValueError, match="--reps"):
        bench.main(["--scenario", "2,1,4,2", "--reps", "3"])


def test_cli_end_to_end_rows_json_plot(tmp_path, capsys):
    js, png = tmp_path / "rows.json", tmp_path / "plot.png"
    rc = bench.main(["--scenario", "4,1,12,4", "--scenario", "4,4,12,4,ragged", "--reps", "5", "--json", str(js),
                     "--plot", str(png)])
    assert rc == 0
    rows = json.loads(js.read_text())
    assert len(rows) == 2 * 2 * 2  # scenarios x modes x baselines (one backend on CPU)
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
    assert "speedup" in capsys.readouterr().out


def test_check_targets():
    base = {"mode": "fwd_bwd", "baseline": "a2a", "backend": "sdpa", "scenario": "s", "R": 32}
    # targets are judged on the paired estimates; the ratio-of-medians fields deliberately disagree here
    rows = [
        dict(base, B=8, G=2, P=256, n=4.0, efficiency=0.5, efficiency_paired=0.9, speedup=1.0,
             speedup_paired=2.5),  # P/R 8, n 4: checked, pass
        dict(base, B=8, G=2, P=256, n=4.0, efficiency=0.95, efficiency_paired=0.8, speedup=2.6,
             speedup_paired=2.2),  # checked, fail
        dict(base, B=8, G=4, P=256, n=2.0, efficiency=0.5, efficiency_paired=0.5, speedup=1.0,
             speedup_paired=1.0),  # n = 2: not a target
        dict(base, B=8, G=8, P=256, n=1.0, efficiency=0.9, efficiency_paired=0.96, speedup=0.9,
             speedup_paired=0.96),  # no sharing, within 5%
        dict(base, B=8, G=8, P=256, n=1.0, efficiency=0.96, efficiency_paired=0.9, speedup=0.96,
             speedup_paired=0.9),  # no sharing, > 5% slower
        {"mode": "plan", "scenario": "p", "B": 512, "G": 64, "plan_fraction": 0.01},
    ]
    out = bench.check_targets(rows)
    assert [line.split()[0] for line in out] == ["PASS", "FAIL", "PASS", "FAIL", "PASS"]


def test_hybrid_flop_model_counts_real_modules():
    """The config-based FLOP terms of the hybrid shape equal 2 x the weights the real modules multiply by."""
    import torch

    model = bench.build_model("hybrid-quick", torch.float32, "cpu")
    cfg = model.config
    kinds = {t: next(layer for layer, lt in zip(model.model.layers, cfg.layer_types) if lt == t)
             for t in ("linear_attention", "full_attention")}

    def linear_weights(module):
        return sum(m.weight.numel() for m in module.modules() if isinstance(m, torch.nn.Linear))

    lin_layer, full_layer = kinds["linear_attention"], kinds["full_attention"]
    state = 6 * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
    assert bench._linear_attention_flops_per_token(cfg) == \
        2 * (linear_weights(lin_layer.linear_attn) + lin_layer.linear_attn.conv1d.weight.numel()) + state
    assert bench._mlp_flops_per_token(cfg) == 2 * linear_weights(full_layer.mlp)
    assert bench._linear_flops_per_token(cfg) == 2 * (linear_weights(full_layer.self_attn) +
                                                      linear_weights(full_layer.mlp))
    # linear-attention layers have no quadratic term: with only such layers the ideal would be the token ratio
    B, G, P, R = 8, 2, 64, 16
    p_len, r_len = torch.full((B,), P), torch.full((B,), R)
    row_group = torch.arange(B) * G // B
    fl = bench.flop_model(cfg, p_len, r_len, row_group, P + R)
    assert fl["baseline_tokens"] == B * (P + R) and fl["zorro_tokens"] == G * P + B * R
    assert fl["baseline"] / fl["zorro"] < (B * (P + R)) / (G * P + B * R) + 1e-9  # the head is the same on both
