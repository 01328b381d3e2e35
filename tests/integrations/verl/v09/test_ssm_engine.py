"""A Mamba-2 hybrid (Bamba: mamba, attention, mamba) through the verl 0.9 zorro engine vs the stock engine.

Same tolerances as test_engine.py (fp32): log-probs / entropy max abs <= 1e-5; loss and grad norm rel <= 1e-5.

The reference is the stock engine with ``use_remove_padding=False`` (as test_hybrid_engine.py): with remove-padding
verl packs the rows into one sequence and transformers' CPU (torch) Mamba-2 path has no sequence boundaries (it
refuses ``seq_idx`` without the fused kernels), so its scan would carry state from one row into the next. Padded, the
stock mixer zeroes the left-padding tokens, which leaves its conv and scan state at zero. zorro runs each response
from its own prompt's state whatever ``use_remove_padding`` says, so it is checked with the default (True).
"""

import pytest
import torch

pytestmark = pytest.mark.usefixtures("verl_cpu")

ATOL = 1e-5
RTOL = 1e-5


@pytest.fixture(scope="module")
def bamba_ckpt(verl_cpu, tmp_path_factory):
    from zorro_verl.testing import tiny_ssm_model

    path = tmp_path_factory.mktemp("tiny_bamba")
    model = tiny_ssm_model("bamba", dtype=torch.float32, seed=0, exact=False)
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(path)
    return str(path)


def test_bamba_infer_and_train_match_stock(bamba_ckpt, strategy):
    """Under FSDP1 the per-instance mixer and decoder-layer forwards zorro installs sit inside verl's units."""
    from tests.support.verl_engines import assert_matches_stock, padded_stock_vs_zorro

    r = padded_stock_vs_zorro(bamba_ckpt, strategy=strategy)
    assert_matches_stock(r, ATOL, RTOL)
