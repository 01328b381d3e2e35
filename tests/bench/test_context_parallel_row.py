"""The context-parallel benchmark row (bench/context_parallel.py) on a batch small enough to count by hand."""

from types import SimpleNamespace

import torch

from zorro_verl.bench.context_parallel import cp_bench_row, packed_positions
from zorro_verl.bench.flops import attention_pairs

CFG = SimpleNamespace(model_type="x", hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=4, intermediate_size=16, vocab_size=10)


def test_hand_counted_row():
    # one prompt of 6 tokens, two responses of 2; cp = 2, tp = 1, bf16 k / v
    p, r, g = torch.tensor([6, 6]), torch.tensor([2, 2]), torch.tensor([0, 0])
    assert packed_positions(p, r, g).tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 6, 7]
    row = cp_bench_row(CFG, p, r, g, cp=2)
    # stock: rows of 8, already a multiple of 2 tp cp = 4; 8 tokens per rank; half of 2 x 36 causal pairs
    assert row["stock_tokens"] == 8 and row["stock_pairs"] == 36
    # zorro: run [0..7] -> pairs {0,1,6,7} / {2,3,4,5}; run [6,7] -> one token each: 5 per rank, T = 10;
    # rank 0 holds positions 0,1,6,7,7 (costs 1+2+7+8+8 = 26), rank 1 positions 2,3,4,5,6 (3+4+5+6+7 = 25)
    assert row["zorro_tokens"] == 5 and row["T"] == 10
    assert row["zorro_pairs_ideal"] == 26 and row["zorro_pairs_dense"] == 50
    # the ranks' pairs sum to the deduplicated forward's (FLOP model: 21 prompt + 2 x (12 + 3) response pairs)
    assert 26 + 25 == attention_pairs(p, r, g, 8)[1] == 51
    # bytes: 2 (cp - 1) L Hkv D x 2 bytes, one layer
    assert row["stock_kv_bytes"] == 2 * 1 * 8 * 1 * 4 * 2
    assert row["zorro_kv_bytes"] == 2 * 1 * 5 * 1 * 4 * 2
    assert row["ordinary_tokens"] == 16
