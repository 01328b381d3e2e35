"""The install probe catches layers that read the packed row instead of each row: it runs three rows of 5, 7 and 7
tokens (two sharing a prompt) through the ordinary forward row by row and through zorro's packed row (16 tokens),
and compares every module's output. A layer that mixes the packed row, or reads its length, is refused at install
naming the module; correct models pass in fp64, fp32 and bf16 (Llama 4 with its query-temperature fix switched off:
test_llama4.py)."""

import pytest
import torch

from zorro_verl.integrations.transformers import install_zorro
from zorro_verl.testing import tiny_model


class _SequenceMean(torch.nn.Module):
    """Adds a tenth of the mean over the sequence axis: on the packed row, every token sees its siblings'."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        y = self.inner(x)
        return y + 0.1 * y.mean(dim=1, keepdim=True)


class _LengthScale(torch.nn.Module):
    """Scales by a function of the sequence length it is given (the packed row's, not the row's)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x) * (1.0 + 0.01 * x.shape[1])


@pytest.mark.parametrize("wrap, name", [(_SequenceMean, "_SequenceMean"), (_LengthScale, "_LengthScale")])
def test_sequence_reading_layer_is_refused(wrap, name):
    model = tiny_model("qwen3")
    model.model.layers[1].mlp = wrap(model.model.layers[1].mlp)
    prev = model.config._attn_implementation
    with pytest.raises(ValueError, match=rf"install probe: module model\.layers\.1\.mlp \({name}, in "
                                         r"model\.layers\.1 \(Qwen3DecoderLayer\)\) gives a different output on "
                                         r"zorro's packed row than on each row alone"):
        install_zorro(model)
    assert model.config._attn_implementation == prev  # restored


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_correct_models_pass_in_every_dtype(kind, dtype):
    """No false refusal: the packed and per-row outputs differ by rounding only, within the dtype's tolerance."""
    rep = install_zorro(tiny_model(kind, dtype=dtype, exact_norms=dtype == torch.float64))
    assert rep["attention_layers"] == 2 and rep["attention_chunk"] == {} and rep["query_temperature"] == []
