"""Vision-language models under verl's Ulysses sequence parallelism (docs/design/verl.md "Ulysses sequence
parallelism"): the zorro engine with SP = 2 against verl 0.9.1's stock engine with SP = 2 (Qwen2.5-VL) and without SP
(Qwen2.5-VL, Qwen3-VL with deepstack features), on CPU over gloo, fp32, FSDP2, two optimizer steps (plain SGD),
2 processes forming one SP group (tests/support/verl_vlm_ulysses.py runs each rank).

verl's stock engine runs VLMs under SP itself: every SP rank encodes the micro-batch's images, merges the features
into the whole packed row and its language model runs the rank's slice of the embeddings and positions. zorro does
the same on its deduplicated packed row: each unique prompt's images once.

Tolerances (docs/design/testing.md, fp32): at every step log-probs / entropy max abs <= 1e-5; loss, grad norm and
every gradient relative <= 1e-5; never the stock fallback.
"""

import json

import pytest

from tests.support import HANG_TIMEOUT_S  # a hang guard, never a speed check

pytestmark = pytest.mark.usefixtures("verl_cpu")  # skips without verl 0.9

ATOL = 1e-5
RTOL = 1e-5
SUMMARY: dict = {}


@pytest.fixture(scope="module")
def vlm_sp_results(tmp_path_factory):
    from tests.support.multi_rank import run_ranks
    from tests.support.verl_vlm import tiny_vlm_checkpoint
    from tests.support.verl_vlm_ulysses import FAMILIES

    root = tmp_path_factory.mktemp("vlm_sp")
    spec = root / "spec.json"
    spec.write_text(json.dumps({"ckpts": {f: tiny_vlm_checkpoint(root, f) for f in FAMILIES}}))
    return run_ranks("tests.support.verl_vlm_ulysses", 2, [spec], root, HANG_TIMEOUT_S)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_zorro_sp2_matches_stock(vlm_sp_results, family):
    from tests.support.verl_engines import assert_steps_match

    refs = ("stock", "stock_sp") if family == "qwen2_5_vl" else ("stock",)
    for r in vlm_sp_results:
        fam = r["families"][family]
        for ref in refs:
            assert_steps_match(fam[ref], ATOL, RTOL)
        assert fam["dedup_ratio"] > 1.0
        # each SP rank's tower encodes the unique prompts' images only: fewer than the stock engines' (every row's)
        imgs = fam["images"]
        assert 0 < imgs["zorro_sp"] < min(imgs[ref] for ref in refs), imgs
        if "stock_sp" in refs:  # the exchanges move the deduplicated row, less than stock SP's rows
            assert 0 < fam["a2a_bytes"]["zorro_sp"] < fam["a2a_bytes"]["stock_sp"], fam["a2a_bytes"]
        SUMMARY[(family, r["rank"])] = {
            ref: {"log-prob": max(e["log_probs"] for e in fam[ref]), "entropy": max(e["entropy"] for e in fam[ref]),
                  "grad rel": max(e["grad_rel"] for e in fam[ref])} for ref in refs}
        print(f"\n{family} rank {r['rank']} ({fam['seconds']:.0f} s): {SUMMARY[(family, r['rank'])]}; images "
              f"{imgs}; all-to-all bytes {fam['a2a_bytes']}; dedup {fam['dedup_ratio']:.2f}")
