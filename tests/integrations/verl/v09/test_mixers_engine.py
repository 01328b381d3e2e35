"""Other sequence mixers through the verl 0.9 zorro engine vs the stock engine: LFM2 (short gated convs and
attention), OLMo-hybrid (its gated delta-net layout and attention) and MiniMax (lightning attention, attention, MoE).

Same tolerances as test_engine.py (fp32): log-probs / entropy max abs <= 1e-5; loss and grad norm rel <= 1e-5.

The reference is the stock engine with ``use_remove_padding=False`` (as test_hybrid_engine.py): with remove-padding
verl packs the rows into one sequence and the families' CPU torch convs / recurrences have no sequence boundaries,
so the stock result would carry conv inputs and state from one row into the next. Padded, the stock mixers zero the
left-padding tokens, which leaves their conv context and state at zero. zorro runs each response from its own
prompt's context and state whatever ``use_remove_padding`` says, so it is checked with the default (True).
Measured (FSDP2 and FSDP1 alike): log-probs / entropy 4.8e-7 (LFM2, OLMo-hybrid), 0 (MiniMax: below fp32's
resolution; its lightning layers move the log-probs by 1.8e-2); gradients 1.6e-7 (LFM2), 1.1e-6 (OLMo-hybrid),
3.2e-7 (MiniMax) relative.
"""

import pytest
import torch

pytestmark = pytest.mark.usefixtures("verl_cpu")

ATOL = 1e-5
RTOL = 1e-5


@pytest.fixture(scope="module", params=["lfm2", "olmo_hybrid", "minimax"])
def mixer_ckpt(verl_cpu, tmp_path_factory, request):
    from zorro_verl.testing import tiny_mixer_model

    path = tmp_path_factory.mktemp(f"tiny_{request.param}")
    model = tiny_mixer_model(request.param, dtype=torch.float32, seed=0, exact=False)
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(path)
    return str(path)


def test_mixers_infer_and_train_match_stock(mixer_ckpt, strategy):
    """Under FSDP1 the per-instance mixer and decoder-layer forwards zorro installs sit inside verl's units."""
    from tests.support.verl_engines import assert_matches_stock, padded_stock_vs_zorro

    r = padded_stock_vs_zorro(mixer_ckpt, strategy=strategy)
    assert_matches_stock(r, ATOL, RTOL)
