"""Lightning attention (MiniMax) on the packed row (zorro_verl.recurrent.lightning): the packed scan vs the
step-by-step definition on each ordinary row, flat plans and prefix trees, values and gradients (fp64)."""

import pytest
import torch

from tests.recurrent.test_recurrent import _batch, _per_row_tokens
from zorro_verl.packing import build_plan
from zorro_verl.recurrent import packed_lightning_attention, recurrent_lightning_ref
from zorro_verl.testing import batch_from_rows, shared_system_rows


def _per_row_check(plan, seed, chunk_size):
    """Packed lightning attention vs each ordinary row's step-by-step recurrence: values at every token and gradients
    of a loss on response tokens only (the prompt's gradient then comes only through the state it hands down)."""
    H, Dk, Dv = 3, 4, 5
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(plan.T, H, Dk, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(plan.T, H, Dv, generator=gen, dtype=torch.float64)
    slope = torch.tensor([0.05, 0.3, 1.1], dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o = packed_lightning_attention(*leaves, slope, plan, chunk_size=chunk_size)  # [T, H, Dv]
    idx, valid = _per_row_tokens(plan)
    rows = [t[idx] * valid[..., None, None] for t in leaves]  # [B, Lmax, H, D], right padded after each row
    o_row, _ = recurrent_lightning_ref(*rows, slope)
    resp = valid & (torch.arange(idx.shape[1])[None, :] >= plan.row_prompt_lens[:, None])
    assert o.shape == (plan.T, H, Dv) and o.dtype == torch.float64
    assert (o[idx[valid]] - o_row[valid]).abs().max().item() < 1e-12
    w = torch.randn(int(resp.sum()), H, Dv, dtype=torch.float64, generator=gen)
    ga = torch.autograd.grad((o[idx[resp]] * w).sum(), leaves)
    gr = torch.autograd.grad((o_row[resp] * w).sum(), leaves)
    for a, r in zip(ga, gr):
        assert r.abs().max().item() > 0.1
        assert (a - r).abs().max().item() < 1e-12 * max(1.0, r.abs().max().item())


@pytest.mark.parametrize("chunk_size", [4, 64])
def test_packed_lightning_equals_per_row_fp64(chunk_size):
    batch = _batch()
    plan = build_plan(batch["input_ids"], batch["attention_mask"], 6)
    assert plan.T < plan.ordinary_tokens
    _per_row_check(plan, seed=5, chunk_size=chunk_size)


def test_packed_lightning_prefix_tree_equals_per_row_fp64():
    """sharing='prefix': the state runs down the trie from each node's parent's final state."""
    from tests.attention.test_tree_backends import branching_rows

    rows = shared_system_rows(2, 2, system_len=9, question_len=2, response_len=5, vocab_size=100, seed=5)
    rows += branching_rows(depth=3, width=2, turn=2, seed=6)
    batch = batch_from_rows(rows)
    plan = build_plan(batch["input_ids"], batch["attention_mask"], batch["responses"].shape[1], sharing="prefix",
                      min_shared_len=1)
    assert plan.tree.levels == 4
    _per_row_check(plan, seed=7, chunk_size=4)


def test_minimax_block_wise_module_is_the_recurrence_fp64():
    """transformers' MiniMaxLightningAttention (block-wise decay, block_size 4 over 11 tokens: full and partial
    blocks) computes the recurrence the packed version runs: its core output vs the definition."""
    from transformers import MiniMaxConfig
    from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention

    torch.manual_seed(0)
    cfg = MiniMaxConfig(hidden_size=24, num_attention_heads=3, head_dim=8, num_hidden_layers=3, block_size=4)
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # the decay buffers computed in fp64 (as from_config(dtype=fp64) does)
    try:
        mod = MiniMaxLightningAttention(cfg, layer_idx=1)
    finally:
        torch.set_default_dtype(dtype)
    h = torch.randn(2, 11, 24, dtype=torch.float64)
    core = {}
    mod.norm.register_forward_hook(lambda m, i, o: core.setdefault("x", i[0]))  # the core output, before the norm
    mod(h, position_embeddings=None, attention_mask=None)
    qkv = mod.act_fn(mod.qkv_proj(h)).reshape(2, 11, 3, 24)
    q, k, v = torch.split(qkv, 8, dim=3)
    o, _ = recurrent_lightning_ref(q, k, v, mod.slope_rate.reshape(3))
    assert (core["x"] - o.reshape(2, 11, 24)).abs().max().item() < 1e-13
