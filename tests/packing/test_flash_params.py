"""flash-attn varlen parameters from a block-causal self-attention mask and from a padding mask (pure torch, CPU)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zorro_verl.packing.flash_params import flash_params_from_attention_mask, flash_params_from_padding_mask


def block_causal(q_lens, k_lens=None) -> torch.Tensor:
    """Brute-force ``[sum q, sum k] bool``: block b's query i sees its keys j <= i + k_len - q_len."""
    k_lens = q_lens if k_lens is None else k_lens
    m = torch.zeros(sum(q_lens), sum(k_lens), dtype=torch.bool)
    q0 = k0 = 0
    for ql, kl in zip(q_lens, k_lens):
        for i in range(ql):
            for j in range(kl):
                m[q0 + i, k0 + j] = j <= i + kl - ql
        q0, k0 = q0 + ql, k0 + kl
    return m


def cu(lens):
    return [0] + torch.tensor(lens).cumsum(0).tolist()


EXAMPLE = block_causal([5, 3, 4])  # three sequences of 5, 3 and 4 tokens


def _encodings(m: torch.Tensor):
    """The same mask in every accepted dtype / value convention."""
    yield "bool", m
    for dt in (torch.int64, torch.int32, torch.uint8):
        yield str(dt), m.to(dt)
    yield "int nonzero", m.long() * 7
    for dt in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        yield f"{dt} 0/1", m.to(dt)
        yield f"{dt} additive -inf", torch.zeros(m.shape, dtype=dt).masked_fill(~m, float("-inf"))
        yield f"{dt} additive finfo.min", torch.zeros(m.shape, dtype=dt).masked_fill(~m, torch.finfo(dt).min)
    yield "float32 additive -1e9", torch.zeros(m.shape).masked_fill(~m, -1e9)
    yield "float32 additive -1e4", torch.zeros(m.shape).masked_fill(~m, -1e4)


@pytest.mark.parametrize("shape", ["2d", "3d", "4d"])
def test_example_in_every_shape_and_dtype(shape):
    for name, m in _encodings(EXAMPLE):
        m = {"2d": m, "3d": m[None], "4d": m[None, None]}[shape]
        p = flash_params_from_attention_mask(m)
        assert p["cu_seqlens_q"].tolist() == [0, 5, 8, 12], name
        assert p["cu_seqlens_k"].tolist() == [0, 5, 8, 12], name
        assert p["cu_seqlens_q"].dtype == torch.int32 and p["cu_seqlens_k"].dtype == torch.int32
        assert p["max_seqlen_q"] == 5 and p["max_seqlen_k"] == 5 and p["num_sequences"] == 3, name
        assert all(type(p[k]) is int for k in ("max_seqlen_q", "max_seqlen_k", "num_sequences"))


def test_device_argument():
    p = flash_params_from_attention_mask(EXAMPLE, device="cpu")
    assert p["cu_seqlens_q"].device.type == "cpu" and p["cu_seqlens_k"].device.type == "cpu"
    p = flash_params_from_padding_mask(torch.ones(2, 3), device=torch.device("cpu"))
    assert p["cu_seqlens_q"].device.type == "cpu"


def test_bottom_right_aligned_blocks():
    q, k = [2, 3, 1, 4], [4, 3, 5, 4]
    p = flash_params_from_attention_mask(block_causal(q, k))
    assert p["cu_seqlens_q"].tolist() == cu(q) and p["cu_seqlens_k"].tolist() == cu(k)
    assert p["max_seqlen_q"] == 4 and p["max_seqlen_k"] == 5 and p["num_sequences"] == 4


def test_single_block_and_single_token():
    p = flash_params_from_attention_mask(block_causal([7]))
    assert p["cu_seqlens_q"].tolist() == [0, 7] and p["num_sequences"] == 1 and p["max_seqlen_q"] == 7
    p = flash_params_from_attention_mask(torch.ones(1, 1, dtype=torch.bool))
    assert p["cu_seqlens_q"].tolist() == [0, 1] and p["max_seqlen_k"] == 1
    # one query over a whole key block (decode-like): bottom-right, it sees every key
    p = flash_params_from_attention_mask(torch.ones(1, 6))
    assert p["cu_seqlens_q"].tolist() == [0, 1] and p["cu_seqlens_k"].tolist() == [0, 6]


def test_one_token_blocks():
    p = flash_params_from_attention_mask(torch.eye(6, dtype=torch.bool))
    assert p["cu_seqlens_q"].tolist() == list(range(7)) and p["num_sequences"] == 6 and p["max_seqlen_q"] == 1


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 6), st.integers(0, 3)), min_size=1, max_size=7), st.booleans())
def test_random_partitions_round_trip(blocks, square):
    q = [b[0] for b in blocks]
    k = q if square else [b[0] + b[1] for b in blocks]
    m = block_causal(q, k)
    p = flash_params_from_attention_mask(m)
    assert p["cu_seqlens_q"].tolist() == cu(q) and p["cu_seqlens_k"].tolist() == cu(k)
    assert p["max_seqlen_q"] == max(q) and p["max_seqlen_k"] == max(k) and p["num_sequences"] == len(q)
    # additive encoding gives the same answer
    add = flash_params_from_attention_mask(torch.zeros(m.shape).masked_fill(~m, float("-inf")))
    assert add["cu_seqlens_k"].tolist() == cu(k)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=6), st.data())
def test_any_single_flip_is_refused(q, data):
    """Every block-causal mask is exact: flipping any one entry makes it invalid (or a different valid mask whose
    parameters then rebuild the flipped mask, never the original's)."""
    m = block_causal(q)
    i = data.draw(st.integers(0, m.shape[0] - 1))
    j = data.draw(st.integers(0, m.shape[1] - 1))
    m2 = m.clone()
    m2[i, j] = ~m2[i, j]
    try:
        p = flash_params_from_attention_mask(m2)
    except ValueError:
        return
    qc, kc = p["cu_seqlens_q"].diff().tolist(), p["cu_seqlens_k"].diff().tolist()
    assert torch.equal(block_causal(qc, kc), m2)  # accepted only if it is itself exactly block-causal


def _raises(m, match):
    with pytest.raises(ValueError, match=match) as e:
        flash_params_from_attention_mask(m)
    assert str(e.value).startswith("attention_mask:")
    return str(e.value)


def test_hole_inside_a_block():
    m = EXAMPLE.clone()
    m[3, 1] = False
    msg = _raises(m, "block-causal")
    assert "query 3" in msg and "key 1" in msg


def test_attended_key_outside_the_diagonal_blocks():
    m = EXAMPLE.clone()
    m[9, 6] = True  # query 9 (block 2) attends key 6 (block 1)
    _raises(m, "expected")
    m = EXAMPLE.clone()
    m[4, 5] = True  # last query of block 0 attends the first key of block 1 (above the diagonal)
    _raises(m, "query 4")


def test_non_causal_upper_triangle():
    m = EXAMPLE.clone()
    m[0, 1] = True
    msg = _raises(m, "block-causal")
    assert "query 0" in msg and "key 1" in msg
    _raises(torch.ones(4, 4), "block-causal")  # full bidirectional attention


def test_padding_style_mask_is_refused():
    # [n, L] padding mask of the old API: 3 sequences of 5, 3, 4 tokens, not a [q, k] block-causal mask
    _raises(torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]]), "padding mask")
    _raises(torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1]]), "expected")  # left-padded rows


def test_structural_errors():
    _raises(torch.zeros(3, 3, dtype=torch.bool), "attending none")
    m = EXAMPLE.clone()
    m[6] = False
    _raises(m, "query 6 attending none")
    _raises(torch.tensor([[0, 1], [0, 1]]), "query 0 to attend key 0")
    _raises(torch.tensor([[1, 0], [1, 1], [1, 1]]), "at least as many keys")  # more queries than keys
    _raises(torch.tensor([[1, 0, 0], [0, 1, 0], [1, 0, 0]]), "down-right")  # a later block starts further left
    _raises(torch.tensor([[1, 0, 0, 0], [0, 0, 1, 1]]), "ambiguous")  # key 1 attended by nobody


def test_value_errors():
    m = EXAMPLE.float()
    soft = torch.zeros(m.shape).masked_fill(m == 0, float("-inf"))
    soft[2, 0] = -0.5
    _raises(soft, "additive")
    mixed = m.clone()
    mixed[0, 5] = float("-inf")  # 1 = attend mixed with an additive -inf
    _raises(mixed, "additive")
    half = m.clone()
    half[1, 0] = 0.5
    _raises(half, "multiplicative")
    nan = m.clone()
    nan[0, 0] = float("nan")
    _raises(nan, "NaN")
    _raises(EXAMPLE.long() - 2 * (~EXAMPLE).long(), "negative")  # int -1 on masked entries
    # an all-zero float mask is additive (all attended): non-causal unless it is one query over one key block
    _raises(torch.zeros(3, 3), "block-causal")
    p = flash_params_from_attention_mask(torch.zeros(1, 4, dtype=torch.float16))
    assert p["cu_seqlens_q"].tolist() == [0, 1] and p["cu_seqlens_k"].tolist() == [0, 4]


def test_container_errors():
    with pytest.raises(TypeError, match="attention_mask: expected a torch.Tensor"):
        flash_params_from_attention_mask(EXAMPLE.tolist())
    with pytest.raises(TypeError, match="complex"):
        flash_params_from_attention_mask(EXAMPLE.to(torch.complex64))
    for bad, match in ((torch.ones(4, dtype=torch.bool), "2-D"), (EXAMPLE[None, None, None], "2-D"),
                       (torch.stack([EXAMPLE, EXAMPLE]), "leading"), (EXAMPLE[None].expand(1, 2, 12, 12), "leading"),
                       (torch.ones(0, 0, dtype=torch.bool), "non-empty"), (torch.ones(3, 0), "non-empty")):
        with pytest.raises(ValueError, match=match):
            flash_params_from_attention_mask(bad)


def _old_padding_params(mask):
    """What ZoRRoTrain.attention_mask_to_flash_attn_params returned for a 2-D mask before the fix."""
    lens = (mask != 0).sum(1).to(torch.int32)
    cu_ = torch.zeros(lens.numel() + 1, dtype=torch.int32)
    cu_[1:] = torch.cumsum(lens, 0)
    return cu_.tolist(), (int(lens.max()) if lens.numel() else 0), int(lens.numel())


@pytest.mark.parametrize("mask", [
    torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]]),
    torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1]], dtype=torch.bool),
    torch.tensor([[0.0, 1.0], [1.0, 1.0]]),
    torch.zeros(0, 4, dtype=torch.long),
    torch.zeros(2, 3, dtype=torch.long),
])
def test_padding_mask_gives_the_old_answer(mask):
    p = flash_params_from_padding_mask(mask)
    cu_, mx, n = _old_padding_params(mask)
    assert p["cu_seqlens_q"].tolist() == cu_ and p["cu_seqlens_k"].tolist() == cu_
    assert p["cu_seqlens_q"].dtype == torch.int32 and p["cu_seqlens_q"] is not p["cu_seqlens_k"]
    assert p["max_seqlen_q"] == p["max_seqlen_k"] == mx and p["num_sequences"] == n


def test_padding_mask_example_and_errors():
    p = flash_params_from_padding_mask(torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]]))
    assert p["cu_seqlens_q"].tolist() == [0, 5, 8, 12] and p["max_seqlen_q"] == 5 and p["num_sequences"] == 3
    with pytest.raises(TypeError, match="padding_mask"):
        flash_params_from_padding_mask([[1, 1]])
    with pytest.raises(ValueError, match="flash_params_from_attention_mask"):
        flash_params_from_padding_mask(EXAMPLE[None])
