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
3.2e-7 (MiniMax) relative. Under Ulysses SP = 2 (two processes) vs the stock engine without SP: the same figures
(LFM2's gradients 1.4e-7).
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


def test_mixers_ulysses_sp2_match_stock(mixer_ckpt, tmp_path):
    """Each family under Ulysses SP = 2 through the zorro engine (FSDP2, two processes over gloo: LFM2's conv
    channels, MiniMax's lightning heads, OLMo-hybrid's delta-net heads exchanged around the mixer) vs verl's stock
    engine without SP, padded (tests/support/verl_ssm_sp.py). Same fp32 tolerances."""
    from tests.support import HANG_TIMEOUT_S
    from tests.support.multi_rank import run_ranks

    for r in run_ranks("tests.support.verl_ssm_sp", 2, [mixer_ckpt], tmp_path, HANG_TIMEOUT_S):
        assert r["fallback"] == [0.0], r  # zorro ran every batch (no stock fallback)
        for key in ("log_probs", "entropy"):
            assert r[f"{key}_scale"] > 0.1 and r[f"{key}_max_abs"] <= ATOL, (key, r)
        la, lb = r["loss"]
        assert abs(la) > 1e-4 and abs(la - lb) <= RTOL * abs(la), r
        if r["grad_norm"] is not None:
            ga, gb = r["grad_norm"]
            assert ga > 1e-4 and abs(ga - gb) <= RTOL * ga, r
        assert r["grad_rel"] <= RTOL, r
        print(f"{mixer_ckpt.rsplit('/', 1)[-1]} rank {r['rank']}: log-prob {r['log_probs_max_abs']:.1e}, entropy "
              f"{r['entropy_max_abs']:.1e}, loss rel {abs(la - lb) / abs(la):.1e}, grad rel {r['grad_rel']:.1e}")
