"""The fp64 gated delta-net oracle forward is the model's own forward (up to the fp64 it keeps)."""

import types

import pytest
import torch

from zorro_verl.testing import tiny_hybrid_model
from zorro_verl.testing.fp64 import _exact_gated_deltanet_forward


def _linear_attn(model):
    return next(m for m in model.modules() if hasattr(m, "chunk_gated_delta_rule") and hasattr(m, "A_log"))


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])  # the two projection layouts
def test_oracle_forward_equals_the_model_forward_in_fp32(kind):
    model = tiny_hybrid_model(kind, dtype=torch.float32, exact=False)
    mod = _linear_attn(model)
    h = torch.randn(2, 7, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = mod(h)
        mod.forward = types.MethodType(_exact_gated_deltanet_forward, mod)  # same kernels, same norm
        out = mod(h)
    assert out.shape == ref.shape == h.shape
    assert (out - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item())


def test_oracle_forward_rows_are_independent_in_fp64():
    model = tiny_hybrid_model("qwen3_5", dtype=torch.float64)  # exact: the oracle forward is installed
    mod = _linear_attn(model)
    h = torch.randn(3, 6, model.config.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        batched = mod(h)
        rows = torch.cat([mod(h[i:i + 1]) for i in range(3)])
        cut = mod(h[:1, :4])  # causal: a prefix sees nothing of the rest of its row
    assert batched.dtype == torch.float64
    assert (batched - rows).abs().max().item() <= 1e-12
    assert (cut - batched[:1, :4]).abs().max().item() <= 1e-12
    with pytest.raises(ValueError, match="attention_mask"):
        mod(h, attention_mask=torch.ones(3, 6))
