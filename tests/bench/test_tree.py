"""The prefix-tree benchmark: the tree FLOP model against brute-force counts, and a tiny end-to-end run (rows,
targets, table)."""

import torch

from zorro_verl.bench.flops import flop_model, linear_flops_per_token, tree_flop_model
from zorro_verl.bench.models import MODEL_SHAPES
from zorro_verl.bench.tree import TreeScenario, check_tree_targets, format_tree_table, run_tree_bench, tree_batches
from zorro_verl.packing import build_plan
from zorro_verl.testing import dense_mask


def _config():
    from transformers import Qwen3Config

    return Qwen3Config(**MODEL_SHAPES["quick"])


def test_tree_flop_model_counts_tokens_pairs_and_head_rows():
    """pairs = ones of the tree plan's dense [T, T] mask; head rows = distinct predicting positions; a depth-one
    tree (GRPO) costs what the prompt plan's FLOP model says."""
    cfg = _config()
    b = tree_batches(TreeScenario("s", "system", 3, 2, 12, 3, 4), 1, "cpu")[0]
    plan = build_plan(b["input_ids"], b["attention_mask"], b["responses"].shape[1], sharing="prefix",
                      min_shared_len=4)
    f = tree_flop_model(cfg, plan)
    assert f["pairs"] == int(dense_mask(plan).sum()) and f["zorro_tokens"] == plan.T
    assert f["head_rows"] == plan.N - 3  # each question's last token predicts both its samples' first tokens
    L, H, D, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.head_dim, cfg.vocab_size
    assert f["zorro"] == L * (linear_flops_per_token(cfg) * plan.T + 4 * cfg.num_attention_heads * D * f["pairs"]) \
        + 2 * H * V * f["head_rows"]
    g = tree_batches(TreeScenario("g", "grpo", 2, 3, 10, 4), 1, "cpu")[0]
    tp = build_plan(g["input_ids"], g["attention_mask"], 4, sharing="prefix")
    pp = build_plan(g["input_ids"], g["attention_mask"], 4)
    ref = flop_model(cfg, pp.row_prompt_lens, pp.response_lens, pp.row_group, g["input_ids"].shape[1])
    # the same work, except that the head runs once on each prompt's last token instead of once per response
    assert tree_flop_model(cfg, tp)["zorro"] == ref["zorro"] - 2 * H * V * (tp.N - tp.head_index.numel())
    assert tp.N - tp.head_index.numel() == 2 * (3 - 1)


def test_tree_bench_end_to_end_tiny():
    scs = (TreeScenario("sys", "system", 2, 2, 70, 2, 3), TreeScenario("turns", "turns", 1, 3, 6, 2, 2),
           TreeScenario("grpo", "grpo", 1, 2, 8, 3))
    rows = run_tree_bench(scs, modes=("fwd_bwd",), reps=5, warmup=1, log=lambda *a: None)
    assert [r["scenario"] for r in rows] == ["sys", "turns", "grpo"]
    for r in rows:
        assert r["logprob_sum_rel_diff"] < 1e-4  # fp32: the three agree
        assert r["prefix_tokens"] <= r["prompt_tokens"] <= r["ordinary_tokens"]
        assert len(r["runs_ms"]["prefix"]) == 5 and r["prefix_ideal"] >= r["prompt_ideal"] * 0.999
    assert rows[1]["prompt_tokens"] == rows[1]["ordinary_tokens"]  # nested multi-turn prompts: no equal prompts
    assert rows[0]["tree_depth"] == 3 and rows[2]["tree_depth"] == 2
    assert rows[1]["tree_depth"] == 1  # each turn's sample is a prefix of the next: one node per trajectory
    lines = check_tree_targets(rows)
    assert any("grpo: prefix / prompt time" in line for line in lines)
    assert all(line.startswith(("PASS", "FAIL")) for line in lines)
    assert format_tree_table(rows).count("\n") == len(rows) + 1
    assert torch.isfinite(torch.tensor(rows[0]["prefix_ms"]))
