"""State-space models through the verl 0.9 zorro engine vs the stock engine: Bamba (mamba, attention, mamba) under
FSDP2 and FSDP1 (and Ulysses SP = 2), Granite-MoE-Hybrid, Nemotron-H, Jamba and Falcon-H1 under FSDP2, Zamba and
Zamba2 under FSDP1 (their hybrid layers nest a Mamba decoder layer that verl's FSDP2 wrapping leaves sharded: the stock
engine fails with mixed Tensor / DTensor).

Left out: ``mamba2``, ``mamba``, ``falcon_mamba`` (no attention): verl's stock engine cannot load them, its
apply_monkey_patch reads ``config.num_attention_heads``, which their configs lack.

Same tolerances as test_engine.py (fp32): log-probs / entropy max abs <= 1e-5; loss and grad norm rel <= 1e-5.

The reference is the stock engine with ``use_remove_padding=False`` (as test_hybrid_engine.py): with remove-padding
verl packs the rows into one sequence and transformers' CPU (torch) Mamba-2 path has no sequence boundaries (it
refuses ``seq_idx`` without the fused kernels), so its scan would carry state from one row into the next. Padded, the
stock mixer zeroes the left-padding tokens, which leaves its conv and scan state at zero. zorro runs each response
from its own prompt's state whatever ``use_remove_padding`` says, so it is checked with the default (True).
"""

import copy

import pytest
import torch

pytestmark = pytest.mark.usefixtures("verl_cpu")

ATOL = 1e-5
RTOL = 1e-5


#: The other state-space families zorro runs exactly that verl's stock engine loads, each under one strategy.
FAMILIES = ("granitemoehybrid", "nemotron_h", "jamba", "zamba", "zamba2", "falcon_h1")


def save_tiny_ssm(kind: str, tmp_path_factory) -> str:
    """A tiny fp32 ``kind`` checkpoint (zorro_verl.testing.tiny_ssm_model; rows of 14 tokens stay within the
    Nemotron-H / Zamba2 torch paths' 32-token chunk) that verl loads through AutoModelForCausalLM."""
    from zorro_verl.testing import tiny_ssm_model

    path = tmp_path_factory.mktemp(f"tiny_{kind}")
    model = tiny_ssm_model(kind, dtype=torch.float32, seed=0, exact=False)
    model.config.architectures = [type(model).__name__]
    if kind == "zamba2":  # save both hybrid layers' (equal) shared blocks: transformers does not re-tie them on
        # load, and a deduplicated checkpoint would leave the second one newly (randomly) initialised in each engine
        layers = model.model.layers
        layers[2].shared_transformer = copy.deepcopy(layers[1].shared_transformer)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def bamba_ckpt(verl_cpu, tmp_path_factory):
    return save_tiny_ssm("bamba", tmp_path_factory)


@pytest.fixture(scope="module", params=FAMILIES)
def family_ckpt(request, verl_cpu, tmp_path_factory):
    return request.param, save_tiny_ssm(request.param, tmp_path_factory)


def test_bamba_infer_and_train_match_stock(bamba_ckpt, strategy):
    """Under FSDP1 the per-instance mixer and decoder-layer forwards zorro installs sit inside verl's units."""
    from tests.support.verl_engines import assert_matches_stock, padded_stock_vs_zorro

    r = padded_stock_vs_zorro(bamba_ckpt, strategy=strategy)
    assert_matches_stock(r, ATOL, RTOL)


def test_ssm_family_infer_and_train_match_stock(family_ckpt):
    """Each other state-space family through the zorro engine vs the stock engine, padded: FSDP2, or FSDP1 for Zamba
    and Zamba2 (module docstring)."""
    from tests.support.verl_engines import assert_matches_stock, padded_stock_vs_zorro

    kind, ckpt = family_ckpt
    r = padded_stock_vs_zorro(ckpt, strategy="fsdp" if kind.startswith("zamba") else "fsdp2")
    print(f"log-prob {r['log_probs']:.1e}, entropy {r['entropy']:.1e}, loss rel "
          f"{abs(r['loss'][0] - r['loss'][1]) / abs(r['loss'][0]):.1e}, grad rel {r['grad_rel']:.1e}")
    assert_matches_stock(r, ATOL, RTOL)


def test_bamba_ulysses_sp2_matches_stock(bamba_ckpt, tmp_path):
    """Bamba under Ulysses SP = 2 through the zorro engine (FSDP2, two processes over gloo; each Mamba-2 layer
    exchanges sequence shards for head shards around its conv and scan) vs verl's stock engine without SP, padded
    (tests/support/verl_ssm_sp.py). Same fp32 tolerances."""
    from tests.support import HANG_TIMEOUT_S
    from tests.support.multi_rank import run_ranks

    for r in run_ranks("tests.support.verl_ssm_sp", 2, [bamba_ckpt], tmp_path, HANG_TIMEOUT_S):
        assert r["fallback"] == [0.0], r  # zorro ran every batch (no stock fallback)
        for key in ("log_probs", "entropy"):
            assert r[f"{key}_scale"] > 0.1 and r[f"{key}_max_abs"] <= ATOL, (key, r)
        la, lb = r["loss"]
        assert abs(la) > 1e-4 and abs(la - lb) <= RTOL * abs(la), r
        if r["grad_norm"] is not None:
            ga, gb = r["grad_norm"]
            assert ga > 1e-4 and abs(ga - gb) <= RTOL * ga, r
        assert r["grad_rel"] <= RTOL, r
        print(f"rank {r['rank']}: log-prob {r['log_probs_max_abs']:.1e}, entropy {r['entropy_max_abs']:.1e}, loss "
              f"rel {abs(la - lb) / abs(la):.1e}, grad rel {r['grad_rel']:.1e}")
