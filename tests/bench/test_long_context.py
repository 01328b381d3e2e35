"""The long-context benchmark's bookkeeping (zorro_verl/bench/long_context.py), without running an engine: the
Ulysses cost model against hand-computed bytes and tokens, the row built from a measured dict (counts checked
against the model, speed-ups, ideal, efficiency), and the extension point another sharding (Megatron CP) plugs into.
The engine run itself (two verl processes) is the benchmark, ``python -m zorro_verl.bench --long``."""

import dataclasses

import pytest

from zorro_verl.bench import long_context as lc

DIMS = lc.AttentionDims(layers=2, heads=4, kv_heads=2, head_dim=16)


def test_ulysses_bytes_and_tokens_equal_the_hand_formula():
    # 2,177 tokens over SP = 2: padded to 2,178, 1,089 per rank. Per layer and direction q, k, v in and the output
    # back: (4 + 2 + 2 + 4) heads x 1,089 tokens x 16 x 4 bytes; 2 layers, forward and backward.
    assert lc.ulysses_rank_tokens(2177, 2) == 1089 and lc.ulysses_rank_tokens(2178, 2) == 1089
    assert lc.ulysses_step_bytes(2177, 2, DIMS, 4) == 12 * 1089 * 16 * 4 * 2 * 2 == 3_345_408
    # one KV head < SP = 2: repeated to 2 before the exchange (4 + 2 + 2 + 4 heads again); bf16 halves the bytes
    one_kv = dataclasses.replace(DIMS, kv_heads=1)
    assert lc.ulysses_step_bytes(2177, 2, one_kv, 2) == 12 * 1089 * 16 * 2 * 2 * 2
    # SP = 4 over 8 KV heads (no repeat): (16 + 8 + 8 + 16) x ceil(1001 / 4) = 251 tokens x 128 x 2 bytes, 28 layers
    qwen = lc.AttentionDims(layers=28, heads=16, kv_heads=8, head_dim=128)
    assert lc.ulysses_step_bytes(1001, 4, qwen, 2) == 48 * 251 * 128 * 2 * 28 * 2
    tokens, sent = lc.rank_totals("sp", [2177, 2900], 2, DIMS, 4)
    assert tokens == 1089 + 1450
    assert sent == 12 * (1089 + 1450) * 16 * 4 * 2 * 2
    # gradient checkpointing: the recompute in the backward exchanges once more (3 passes per layer)
    assert lc.rank_totals("sp", [2177, 2900], 2, DIMS, 4, recompute=True) == (tokens, sent // 2 * 3)


def _measured(counted_offset: int = 0) -> dict:
    """A measured dict as an engine run returns it: 2 groups x 2 rows (prompts of 10 tokens), stock one row per
    micro-batch, zorro one group per micro-batch; counts as the cost model gives them (+ ``counted_offset`` bytes on
    rank 1 of zorro)."""
    p, r, g = [10, 10, 10, 10], [3, 4, 5, 6], [0, 1, 0, 1]
    stock_mb, zorro_rows = [13, 14, 15, 16], [[0, 2], [1, 3]]
    zorro_mb = [10 + 3 + 5, 10 + 4 + 6]
    st_tok, st_bytes = sum(-(-t // 2) for t in stock_mb), sum(lc.ulysses_step_bytes(t, 2, DIMS, 4) for t in stock_mb)
    z_tok, z_bytes = sum(-(-t // 2) for t in zorro_mb), sum(lc.ulysses_step_bytes(t, 2, DIMS, 4) for t in zorro_mb)
    return {"sharding": "sp", "degree": 2, "clock": "cpu", "device": "cpu", "element_size": 4, "recompute": False,
            "p_len": p, "r_len": r, "group": g, "logprob_max_abs_diff": 2e-7,
            "stock": {"train_ms": [40.0, 30.0, 50.0], "infer_ms": [20.0, 10.0, 30.0], "mb_tokens": stock_mb,
                      "rank_tokens": [st_tok, st_tok], "comm_bytes": [st_bytes, st_bytes]},
            "zorro": {"train_ms": [20.0, 10.0, 20.0], "infer_ms": [10.0, 5.0, 10.0], "mb_tokens": zorro_mb,
                      "mb_rows": zorro_rows, "rank_tokens": [z_tok, z_tok],
                      "comm_bytes": [z_bytes, z_bytes + counted_offset]}}


@pytest.fixture(scope="module")
def cfg():
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, intermediate_size=128, tie_word_embeddings=False)


SC = lc.LongScenario("t", 2, 2, 10, 3, 6, 16)


def test_row_from_measured(cfg):
    row = lc.long_row("verl-fsdp", SC, _measured(), cfg)
    assert row["parallel"] == "SP=2" and row["collective"] == "all-to-all"
    # tokens: stock 13 + 14 + 15 + 16 = 58 over 4 micro-batches, each rank ceil(t / 2): 7 + 7 + 8 + 8
    assert row["stock_tokens"] == 58 and row["stock_rank_tokens"] == row["stock_rank_tokens_model"] == 30
    # zorro: each group's 10-token prompt once per micro-batch: 18 + 20 tokens, 9 + 10 per rank
    assert row["zorro_tokens"] == 38 and row["zorro_rank_tokens"] == row["zorro_rank_tokens_model"] == 19
    assert row["stock_comm_bytes"] == 12 * 30 * 16 * 4 * 2 * 2 and row["zorro_comm_bytes"] == 12 * 19 * 16 * 4 * 2 * 2
    assert row["stock_counts_match"] and row["zorro_counts_match"]
    assert row["comm_ratio"] == pytest.approx(19 / 30) and row["token_ratio"] == pytest.approx(38 / 58)
    # medians 40 / 20 ms; paired: median of 40/20, 30/10, 50/20 = 2.5
    assert row["stock_train_ms"] == 40.0 and row["zorro_train_ms"] == 20.0 and row["speedup_train"] == 2.0
    assert row["speedup_train_paired"] == 2.5 and row["speedup_infer_paired"] == 2.0
    assert row["efficiency_train"] == pytest.approx(2.5 / row["ideal_train"])
    assert row["ideal_infer"] > 1.0 and row["ideal_train"] > 1.0
    lines = lc.check_long_rows([row])
    assert len(lines) == 2 and all(x.startswith("PASS") for x in lines)
    table = lc.format_long_table([row]).splitlines()
    assert len(table) == 4 and "| train |" in table[2] and "| infer |" in table[3]


def test_a_count_off_the_model_fails(cfg):
    row = lc.long_row("verl-fsdp", SC, _measured(counted_offset=4), cfg)
    assert row["stock_counts_match"] and not row["zorro_counts_match"]
    assert lc.check_long_rows([row])[0].startswith("FAIL")


def test_ideal_counts_each_prompt_once_per_micro_batch(cfg):
    """The ideal follows zorro's micro-batches: splitting a group pays its prompt twice (lower ideal)."""
    from zorro_verl.bench.e2e import stock_flops
    from zorro_verl.bench.flops import layer_costs

    m = _measured()
    whole = lc.long_flops(cfg, m["p_len"], m["r_len"], m["group"], [[0, 2], [1, 3]])
    split = lc.long_flops(cfg, m["p_len"], m["r_len"], m["group"], [[0], [2], [1, 3]])
    assert split["zorro"] > whole["zorro"] and split["ideal_infer"] < whole["ideal_infer"]
    # zorro's forward by hand: 38 tokens through the layers, causal prompt pairs + responses against their prompt,
    # the head on the 18 response-predicting rows
    L, per_token, per_pair = layer_costs(cfg)
    pairs = 2 * 55 + sum(10 * r + r * (r + 1) // 2 for r in (3, 4, 5, 6))
    assert whole["zorro"] == per_token * 38 + L * per_pair * pairs + 2 * 64 * 512 * 18
    import torch

    assert whole["stock"] == stock_flops(cfg, torch.tensor(m["p_len"]), torch.tensor(m["r_len"]))


@pytest.fixture
def cp_registered():
    """A context-parallel cost model and engine registered for the test (a stand-in with a hand formula: each rank
    holds 2 of the row's ``2 cp`` chunks and sends its K and V once per layer and direction), removed after."""

    def rank_tokens(t, cp):
        return 2 * -(-t // (2 * cp))

    def step_bytes(t, cp, dims, es, recompute):
        return 2 * dims.layers * 2 * dims.kv_heads * rank_tokens(t, cp) * dims.head_dim * es

    def run(sc, settings):
        m = _measured()
        m["sharding"] = "cp"
        for side in ("stock", "zorro"):
            t = sum(rank_tokens(x, 2) for x in m[side]["mb_tokens"])
            b = sum(step_bytes(x, 2, DIMS, 4, False) for x in m[side]["mb_tokens"])
            m[side].update(rank_tokens=[t, t], comm_bytes=[b, b])
        return m

    saved = lc.SHARDINGS["cp"]
    lc.register_sharding(lc.ShardingModel("cp", "context parallel (test model)", "K/V exchange", rank_tokens,
                                          step_bytes))
    lc.register_long_engine(lc.LongEngine("cp-test", "cp", run))
    yield
    del lc.LONG_ENGINES["cp-test"]
    lc.register_sharding(saved)


def test_another_sharding_plugs_in_with_the_same_columns(cfg, cp_registered):
    cp = lc.run_long_bench([SC], engine="cp-test", model="long-tiny", log=lambda *a: None)[0]
    sp = lc.long_row("verl-fsdp", SC, _measured(), cfg)
    assert set(cp) - {"model", "dtype", "reps", "warmup", "backend", "grad_ckpt", "git_sha", "versions"} == set(sp)
    assert cp["parallel"] == "CP=2" and cp["collective"] == "K/V exchange"
    # stock's 13..16-token rows: 2 chunks of ceil(t / 4) = 4 tokens each per rank
    assert cp["stock_rank_tokens"] == 4 * 8 and cp["stock_comm_bytes"] == 2 * 2 * 2 * 2 * 32 * 16 * 4
    assert cp["stock_counts_match"] and cp["zorro_counts_match"]
    assert "CP=2" in lc.format_long_table([cp])


def test_unregistered_sharding_and_engine_are_named():
    with pytest.raises(ValueError, match="no cost model registered for sharding 'pp'.*register_sharding"):
        lc.sharding_model("pp")
    with pytest.raises(ValueError, match="no cost model registered"):
        lc.register_long_engine(lc.LongEngine("megatron-pp", "pp", lambda sc, s: {}))
    with pytest.raises(ValueError, match="no long-context run registered for 'deepspeed'.*verl-fsdp.*verl-megatron"):
        lc.long_engine("deepspeed")
    assert "megatron-pp" not in lc.LONG_ENGINES
    assert lc.long_engine("verl-megatron").sharding == "cp"


def test_cp_bytes_and_tokens_equal_the_hand_formula(cfg):
    """Megatron CP: a micro-batch's CP buffer (stock: verl's THD rows padded to 2 cp; zorro: cp slices of L) over
    the ranks; each rank receives the other ranks' K and V once per layer in the forward (again in a recompute)."""
    assert lc.cp_rank_tokens(2184, 2) == 1092
    # 2 layers x (cp - 1) = 1 other rank x 1,092 tokens x (K + V) x 2 KV heads x 16 x 4 bytes
    assert lc.cp_step_bytes(2184, 2, DIMS, 4) == 2 * 1092 * 2 * 2 * 16 * 4
    assert lc.cp_step_bytes(2184, 2, DIMS, 4, recompute=True) == 2 * lc.cp_step_bytes(2184, 2, DIMS, 4)
    qwen = lc.AttentionDims(layers=36, heads=32, kv_heads=8, head_dim=128)
    assert lc.cp_step_bytes(4 * 1000, 4, qwen, 2) == 36 * 3 * 1000 * 2 * 8 * 128 * 2
    # a stock side whose exchange is not counted (Transformer Engine's on a GPU): the model's bytes, flagged
    m = _measured()
    m["sharding"] = "cp"
    for side, mbs in (("stock", [16, 16, 16, 16]), ("zorro", [18, 20])):
        t = sum(x // 2 for x in mbs)
        b = sum(lc.cp_step_bytes(x, 2, lc.AttentionDims.of(cfg), 4) for x in mbs)
        m[side].update(mb_tokens=mbs, rank_tokens=[t, t], comm_bytes=[b, b])
    m["stock"]["comm_bytes"] = [None, None]
    row = lc.long_row("verl-megatron", SC, m, cfg)
    assert row["parallel"] == "CP=2" and row["collective"] == "K/V all-gather (fwd)"
    assert not row["stock_comm_counted"] and row["zorro_comm_counted"]
    assert row["stock_comm_bytes"] == row["stock_comm_bytes_model"] == 2 * 32 * 2 * 2 * 16 * 4
    assert row["stock_counts_match"] and row["zorro_counts_match"]


def test_scenarios_and_rows():
    assert lc.parse_long_scenario("16k-n16").P == 16384
    sc = lc.parse_long_scenario("2,8,2048,64,128,2048")
    assert (sc.B, sc.P, sc.budget) == (16, 2048, 2048)
    with pytest.raises(ValueError, match="cannot hold a row"):
        lc.LongScenario("x", 1, 2, 100, 1, 20, 50).check(2)
    for s in lc.LONG_CPU_SCENARIOS + lc.LONG_GPU_SCENARIOS:
        s.check(2)
    rows = lc.long_rows(lc.LongScenario("x", 2, 3, 12, 2, 5, 32), vocab=50)
    assert len(rows) == 6 and all(len(p) == 12 and 2 <= len(r) <= 5 for p, r in rows)
    assert len({tuple(p) for p, _ in rows}) == 2
    assert any(rows[i][0] != rows[i + 1][0] for i in range(5))  # shuffled: not every sibling adjacent


def test_cli_long_flags_need_long():
    from zorro_verl.bench.cli import main

    with pytest.raises(ValueError, match="add --long"):
        main(["--long-scenario", "2k-n8"])
    with pytest.raises(ValueError, match="belong to the other benchmarks"):
        main(["--long", "--tree"])


def test_stock_flash_varlen_stand_in_equals_the_masked_reference():
    """The stock SP engine's CPU kernel on the long run (each packed row's causal attention alone) equals the masked
    whole-micro-batch reference the Ulysses tests use (fp64, GQA, three packed rows, one of a single token)."""
    import torch

    from tests.support.cpu_stock_kernels import flash_varlen_kernel
    from tests.support.verl_ulysses import _cpu_varlen_kernel

    g = torch.Generator().manual_seed(0)
    lens = [5, 1, 7]
    T = sum(lens)
    q = torch.randn(1, T, 4, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, T, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    got = flash_varlen_kernel(q, k, v, None, T, position_ids=pos, is_causal=True, softmax_scale=0.3)
    ref = _cpu_varlen_kernel(q, k, v, None, T, position_ids=pos, is_causal=True, softmax_scale=0.3)
    assert got.shape == (1, T, 4, 8)
    assert (got - ref).abs().max().item() <= 1e-12
    with pytest.raises(ValueError, match="remove-padding forward"):
        flash_varlen_kernel(q, k, v, torch.ones(1, T), T, position_ids=pos)
