"""The main job (`zorro-verl demo`) end to end on a small configuration, and the CLI dispatch."""

import json

from zorro_verl.cli import main

SMALL = ["-B", "6", "-G", "2", "-P", "20", "-R", "5", "--layers", "2", "--hidden", "32", "--repeats", "1"]


def test_demo_matches_and_reports(tmp_path, capsys):
    out_json = tmp_path / "demo.json"
    assert main(["demo", *SMALL, "--temperature", "0.7", "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    for row in ("tokens ordinary -> dedup", "ideal speedup", "max |d log-prob|", "max rel grad error",
                "ordinary fwd+bwd (median)", "zorro fwd+bwd (median)", "MATCH"):
        assert row in text
    res = json.loads(out_json.read_text())
    assert res["ok"] and res["tokens_dedup"] < res["tokens_ordinary"]
    assert res["max_abs_logprob_diff"] <= 1e-9 and res["max_rel_grad_err"] <= 1e-9
    # ideal token ratio of the batch: ordinary valid tokens / packed tokens
    assert abs(res["ideal_speedup"] - res["tokens_ordinary"] / res["tokens_dedup"]) < 1e-12


def test_demo_fp32_memory_mode():
    assert main(["demo", *SMALL, "--dtype", "float32", "--logits", "memory", "--attn", "eager"]) == 0


def test_cli_usage_and_unknown_command(capsys):
    assert main([]) == 2
    assert main(["--help"]) == 0
    assert main(["frobnicate"]) == 2
    assert "unknown command" in capsys.readouterr().err
