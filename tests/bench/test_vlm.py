"""The vision-language benchmark (``--vlm``): the vision tower's FLOP model against a hand count and against what
the real Qwen2.5-VL tower computes (its linear weights, the (query, key) pairs of its attention calls), and a tiny
end-to-end run (rows, zorro's log-probs equal to the ordinary forward's, targets, table, command line)."""

import json

import pytest
import torch

from zorro_verl import bench
from zorro_verl.bench.flops import (
    flop_model,
    vision_attention_pairs,
    vision_flops,
    vision_patch_flops,
    vlm_flop_model,
)
from zorro_verl.bench.vlm import (
    VlmScenario,
    check_vlm_targets,
    format_vlm_table,
    parse_vlm_scenario,
    run_vlm_bench,
    scenario_flops,
)
from zorro_verl.testing.vlm import tiny_vlm_config, tiny_vlm_model


def _vcfg():
    """Tiny Qwen2.5-VL tower: hidden 16, MLP 32, 2 heads, patch 4, temporal patch 2, 3 channels, merge 2, out 32,
    window 16 pixels = 2 x 2 merged tokens, depth 2 (block 0 windowed, block 1 full)."""
    return tiny_vlm_config("qwen2_5_vl").vision_config


def test_vision_flops_hand_count():
    """One image of 6 x 4 patches (3 x 2 merged tokens), counted by hand.

    embed = 2 * (3*2*4*4) * 16 = 3072 per patch; a block = 2 * (4 * 16^2 + 3 * 16 * 32) = 5120, two blocks 10240;
    merger = 2 * 16 * (16 * 4 + 32) = 3072 per patch -> 13312 per patch besides the embedding. Windows: merged rows
    [2, 1] x columns [2] -> windows of 16 and 8 patches: 256 + 64 = 320 pairs; full block: 24^2 = 576 pairs; 4 * 16
    FLOPs a pair. fwd = 24 * (3072 + 13312) + 64 * (320 + 576) = 450560; fwd_bwd = 2 * 3072 * 24 (no pixel
    gradient) + 3 * (13312 * 24 + 64 * 896) = 1277952."""
    v = _vcfg()
    assert vision_patch_flops(v) == (3072, 13312)
    assert vision_attention_pairs(v, (1, 6, 4)) == (320, 576)
    f = vision_flops(v, torch.tensor([[1, 6, 4]]))
    assert f == {"fwd": 450560, "fwd_bwd": 1277952, "patches": 24, "items": 1}
    # a 2-frame video of 4 x 4 patches: one window of 16 patches per frame, full attention per frame
    assert vision_attention_pairs(v, (2, 4, 4)) == (2 * 256, 2 * 256)
    two = vision_flops(v, torch.tensor([[1, 6, 4], [2, 4, 4]]))
    assert two["fwd"] == 450560 + 32 * 16384 + 64 * 1024 and two["items"] == 2 and two["patches"] == 56


def test_vision_flops_count_the_real_towers_weights_and_attention_calls(monkeypatch):
    """Per patch: 2 x the tower's linear weights (the merger's per merged token / merge^2; the patch embedding is
    the Conv3d's weight); pairs: q_len x k_len of every SDPA call the tower makes, for odd grids (cut windows)."""
    model = tiny_vlm_model("qwen2_5_vl", dtype=torch.float32, vision_depth=3)
    vis, v = model.model.visual, model.config.vision_config
    assert v.fullatt_block_indexes == [2]  # blocks 0, 1 windowed, 2 full
    lin = lambda mod: sum(x.weight.numel() for x in mod.modules() if isinstance(x, torch.nn.Linear))  # noqa: E731
    embed, per_patch = vision_patch_flops(v)
    assert embed == 2 * vis.patch_embed.proj.weight.numel()
    assert per_patch == 2 * lin(vis.blocks) + 2 * lin(vis.merger) // v.spatial_merge_size ** 2
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, val, *args, **kwargs):
        calls.append(q.shape[-2] * k.shape[-2])
        return sdpa(q, k, val, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    grids = torch.tensor([[1, 6, 4], [1, 10, 6], [2, 4, 8], [1, 2, 2]])
    with torch.no_grad():
        vis(torch.randn(int(grids.prod(-1).sum()), 96), grid_thw=grids)
    f = vision_flops(v, grids)
    attn = f["fwd"] - (embed + per_patch) * f["patches"]
    assert attn == 4 * v.hidden_size * sum(calls)
    assert f["patches"] == int(grids.prod(-1).sum())


def test_vlm_flop_model_adds_the_tower_to_the_text_model():
    cfg = tiny_vlm_config("qwen2_5_vl")
    B, G = 6, 2
    p_len, r_len = torch.full((B,), 20), torch.tensor([3, 4, 5, 3, 4, 5])
    row_group = torch.arange(B) % G
    rows = torch.tensor([[1, 4, 4]] * B)
    packed = torch.tensor([[1, 4, 4]] * G)
    f = vlm_flop_model(cfg, p_len, r_len, row_group, 25, rows, packed)
    text = flop_model(cfg.text_config, p_len, r_len, row_group, 25)
    vb, vz = vision_flops(cfg.vision_config, rows), vision_flops(cfg.vision_config, packed)
    assert f["baseline"] == text["baseline"] + vb["fwd"] and f["zorro"] == text["zorro"] + vz["fwd"]
    assert f["baseline_fwd_bwd"] == text["baseline_fwd_bwd"] + vb["fwd_bwd"]
    assert f["zorro_fwd_bwd"] == text["zorro_fwd_bwd"] + vz["fwd_bwd"]
    assert f["vision_baseline"] == 3 * f["vision_zorro"]  # n = 3: each image encoded by 3 rows vs once
    assert (f["images_baseline"], f["images_zorro"], f["patches_zorro"]) == (6, 2, 32)


def test_vision_flop_model_refuses_other_towers():
    with pytest.raises(ValueError, match="Qwen2.5-VL"):
        vision_patch_flops(tiny_vlm_config("qwen3_vl").vision_config)


def test_parse_vlm_scenario():
    assert parse_vlm_scenario("img256") == VlmScenario("img256", 16, 2, 256, 32, 32)
    sc = parse_vlm_scenario("8,2,16,8,4,2")
    assert (sc.B, sc.G, sc.n, sc.image_tokens, sc.text_tokens, sc.R, sc.images, sc.P) == (8, 2, 4, 16, 8, 4, 2, 40)
    with pytest.raises(ValueError, match="square"):
        parse_vlm_scenario("4,2,15,8,4")
    with pytest.raises(ValueError, match="--vlm-scenario"):
        parse_vlm_scenario("nope")


def test_vlm_bench_end_to_end_tiny():
    """The --vlm path at a tiny size: every field, zorro's log-probs equal to the ordinary forward's (fp32, 1e-5,
    measured inside the run), the items each side's tower encoded, the targets' lines and the table."""
    scs = (VlmScenario("share", 6, 2, 16, 8, 3), VlmScenario("two", 4, 1, 4, 6, 2, images=2),
           VlmScenario("none", 3, 3, 4, 4, 2))
    rows = run_vlm_bench(scs, modes=("fwd", "fwd_bwd"), reps=5, warmup=1, log=lambda *a: None)
    assert [(r["scenario"], r["mode"]) for r in rows] == [(s.name, m) for s in scs for m in ("fwd", "fwd_bwd")]
    required = {"B", "G", "n", "P", "R", "image_tokens", "text_tokens", "images_per_prompt", "ordinary_ms",
                "zorro_ms", "plan_ms", "plan_fraction", "speedup", "speedup_paired", "ideal_speedup",
                "efficiency_paired", "text_ideal",
                "vision_ideal", "images_ordinary", "images_zorro", "ordinary_tokens", "zorro_tokens",
                "ordinary_runs_ms", "zorro_runs_ms", "logprob_max_abs_diff", "device", "git_sha", "versions"}
    for r, sc in zip(rows, [s for s in scs for _ in range(2)]):
        assert required <= set(r)
        assert r["logprob_max_abs_diff"] <= 1e-5
        assert len(r["zorro_runs_ms"]) == 5 and r["zorro_ms"] == pytest.approx(sorted(r["zorro_runs_ms"])[2])
        assert 0 < r["plan_ms"] and len(r["plan_runs_ms"]) == 5
        assert r["images_ordinary"] == r["images_ordinary_flop_model"] == sc.B * sc.images  # hook == FLOP model
        assert r["images_zorro"] == r["images_zorro_flop_model"] == sc.G * sc.images
        assert r["vision_ideal"] == pytest.approx(sc.n)
        assert r["ordinary_tokens"] == sc.B * (sc.P + sc.R)
        assert r["zorro_tokens"] == sc.G * sc.P + sc.B * sc.R
        assert r["efficiency_paired"] == pytest.approx(r["speedup_paired"] / r["ideal_speedup"])
    assert rows[-1]["ideal_speedup"] == pytest.approx(1.0)  # nothing shared
    from zorro_verl.bench.models import build_vlm_config

    cfg = build_vlm_config("vlm-quick")  # the batches' FLOPs = the scenario's, from the config alone
    for r, sc in zip(rows, [s for s in scs for _ in range(2)]):
        assert r["ideal_speedup"] == pytest.approx(scenario_flops(cfg, sc)[
            "ideal_fwd_bwd" if r["mode"] == "fwd_bwd" else "ideal"], rel=1e-12)
    lines = check_vlm_targets(rows)
    assert all(line.startswith(("PASS", "FAIL", "INFO")) for line in lines)
    assert sum("log-probs" in line for line in lines) == 3 and all(
        line.startswith("PASS") for line in lines if "log-probs" in line)
    assert [line for line in lines if line.startswith("INFO")][0].startswith("INFO none: zorro / ordinary time")
    assert format_vlm_table(rows).count("\n") == len(rows) + 1


def test_vlm_cli_json_and_flag_errors(tmp_path, capsys):
    js = tmp_path / "vlm.json"
    rc = bench.main(["--vlm", "--vlm-scenario", "4,2,4,4,2", "--modes", "fwd_bwd", "--json", str(js)])
    rows = json.loads(js.read_text())
    assert rc in (0, 1) and len(rows) == 1 and rows[0]["mode"] == "fwd_bwd" and rows[0]["model"] == "vlm-quick"
    out = capsys.readouterr().out
    assert "| scenario | B | n |" in out and "log-probs max" in out and "vision-language benchmark" in out
    with pytest.raises(ValueError, match="--vlm"):
        bench.main(["--vlm", "--tree"])
    with pytest.raises(ValueError, match="--vlm-scenario"):
        bench.main(["--vlm", "--scenario", "2,1,4,2"])
    with pytest.raises(ValueError, match="--model"):
        bench.main(["--vlm", "--model", "quick"])
    with pytest.raises(ValueError, match="add --vlm"):
        bench.main(["--vlm-scenario", "img256"])


def test_vlm_settings_cpu_and_gpu():
    """--vlm alone: the CPU set with its targets; --preset gpu: the issue's scenario (1,024 image + 64 text tokens,
    n = 8, R = 128) on the Qwen2.5-VL-3B shape in bf16 (defined here; its ideal from the config: ~5.5x)."""
    from zorro_verl.bench.cli import _parser, resolve_vlm
    from zorro_verl.bench.models import build_vlm_config

    cpu = resolve_vlm(_parser().parse_args(["--vlm"]))
    assert (cpu.device, cpu.dtype, cpu.model, cpu.threads, cpu.targets) == ("cpu", "float32", "vlm-quick", 1, True)
    assert [s.name for s in cpu.scenarios] == ["img256", "2img64", "noshare"]
    gpu = resolve_vlm(_parser().parse_args(["--vlm", "--preset", "gpu"]))
    assert (gpu.device, gpu.dtype, gpu.model, gpu.grad_ckpt) == ("cuda", "bfloat16", "qwen2.5-vl-3b", True)
    (sc,) = gpu.scenarios
    assert (sc.B, sc.n, sc.image_tokens, sc.text_tokens, sc.R) == (16, 8, 1024, 64, 128)
    assert 5.0 < scenario_flops(build_vlm_config(gpu.model), sc)["ideal_fwd_bwd"] < 6.0
    moved = resolve_vlm(_parser().parse_args(["--vlm", "--device", "cuda"]))
    assert not moved.targets  # targets belong to the preset's device
