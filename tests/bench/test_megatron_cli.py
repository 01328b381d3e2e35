"""The Megatron benchmark's parts that need no megatron-core: scenarios, the FLOP dimensions, the command line's
refusals, and the layering (importing the bench module does not import megatron-core). The run itself is tested in
.venv-megatron (tests/integrations/megatron/test_bench_megatron.py)."""

import subprocess
import sys

import pytest

from zorro_verl.bench import main
from zorro_verl.bench.flops import flop_model
from zorro_verl.bench.megatron import MEGATRON_SCENARIOS, MegatronScenario, flop_config, parse_megatron_scenario


def test_parse_megatron_scenario():
    assert parse_megatron_scenario("grpo") == MEGATRON_SCENARIOS[0] == MegatronScenario("grpo", 16, 2, 256, 32, 64)
    sc = parse_megatron_scenario("8,2,64,4,8")
    assert (sc.B, sc.G, sc.n, sc.p_min, sc.P, sc.R_min, sc.R_max) == (8, 2, 4, 56, 64, 4, 8)
    for bad in ("nope", "8,3,64,4,8", "8,2,64,9,8"):
        with pytest.raises(ValueError):
            parse_megatron_scenario(bad)


def test_flop_config_counts_the_gpt_dimensions():
    """quick: per layer q/o 256x256, k/v 256x128, SwiGLU 3 x 256 x 768; 4 layers; 4 heads of 64 -> 1024 FLOPs a
    pair; head 256 x 4096."""
    import torch

    cfg = flop_config("quick")
    f = flop_model(cfg, torch.tensor([3]), torch.tensor([2]), torch.tensor([0]), 5)
    per_token = 4 * 2 * (2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 768)
    assert f["zorro"] == 5 * per_token + 4 * 1024 * 15 + 2 * 256 * 4096 * 2
    assert f["baseline_full"] == 5 * per_token + 4 * 1024 * 15 + 2 * 256 * 4096 * 5


def test_megatron_flags_refused_where_they_do_not_belong():
    with pytest.raises(ValueError, match="add --megatron"):
        main(["--megatron-scenario", "grpo"])
    with pytest.raises(ValueError, match="belong to the other benchmarks"):
        main(["--megatron", "--vlm"])


def test_bench_megatron_imports_no_megatron():
    code = ("import sys, zorro_verl.bench.megatron, zorro_verl.bench.cli; "
            "assert not any(m.startswith('megatron') for m in sys.modules), 'megatron imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
