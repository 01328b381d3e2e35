"""A pairwise configuration matrix of the verl 0.9 FSDP engine: every PAIR of the options users combine, each case
the zorro engine vs verl 0.9.1's stock engine on the same batches, or a refusal by name.

Options (:data:`tests.support.verl_matrix.FACTORS`): strategy (fsdp, fsdp2), LoRA, ``use_fused_kernels``, Ulysses
SP (1, 2), sharing (prompt, prefix), ``logits_optimization`` (none, compute, memory), ``use_dynamic_bsz``, gradient
checkpointing, ``param_offload``, the model (tiny dense Qwen3; Qwen2.5-VL, of the Qwen2-VL family; Qwen3.5 with
gated delta-net layers) and a critic-present trainer. 3 x 3 x 2^9 = 4608 combinations; the cases are a covering
array of strength 2 (:func:`tests.support.covering.pairwise`: deterministic greedy, its size printed and asserted
below :data:`MAX_CASES`): every pair of two options' levels occurs in a case that runs, except the pairs zorro
refuses (:data:`REFUSED`), which each get a case of their own that must raise the refusal whose record
(zorro_verl/refusals.py, docs/refusals.md) names it. :data:`FORBIDDEN` lists real impossibilities (none so far).

Per case (tests/support/verl_matrix.py), in ONE 2-rank gloo group started once for the module (SP = 1 cases run as
DP = 2; SP = 2 as one SP group): two optimizer steps (inference pass, then a training step, plain SGD) of the stock
engine and the zorro engine with the case's settings; at every step log-probs, entropy, loss, grad norm and every
gradient must agree (fp32: 1e-5 abs / rel, as the other engine tests) and zorro must never run its stock fallback.
The stock reference differs where verl's own path is no CPU reference (:func:`tests.support.verl_matrix
.reference_settings`: no SP, no fused kernels, the hybrid padded, the VLM's flash kernels stood in), each as the
single-option tests already use it.

The critic-present trainer: zorro's group-aware balancing (``group_balance_mode: keep_minibatches``) must place
rows so that every optimizer step of the actor AND of the critic keeps verl's rows, so it asks for the critic's DP
size, under the mesh verl 0.9.1's critic worker (``TrainingWorker``) registers: ``"train"``. Such a case orders its
global batch through verl's real ``RayPPOTrainer._balance_batch`` with zorro's hook, the critic's worker group
registered under that mesh only, as read from ``TrainingWorker.__init__``'s own registration (querying any other
mesh fails, and the hook would then keep verl's placement and count a fallback); the test asserts no fallback and
that the engine saw zorro's balance stamp, and the engines then run on that order (each DP rank its chunk).
"""

import json

import pytest
import torch

from tests.support import HANG_TIMEOUT_S  # a hang guard, never a speed check
from tests.support.covering import pairwise, row_pairs, uncovered
from tests.support.verl_matrix import FACTORS

pytestmark = pytest.mark.usefixtures("verl_cpu")  # skips without verl 0.9

ATOL = 1e-5
RTOL = 1e-5
#: The Qwen2-VL-family model of the matrix (tests/support/verl_vlm.py's families).
VLM_FAMILY = "qwen2_5_vl"
#: Pairs zorro refuses (each with the key of its zorro_verl/refusals.py record): one case each, which must raise it.
REFUSED = {
    (("model", "vlm"), ("fused", True)): "fsdp.vlm_fused",
}
#: Pairs no case may hold: real impossibilities (a combination verl itself cannot run). None.
FORBIDDEN = ()
#: The matrix's size (cases that run + refusal cases): the generated array has 12 + 1 (each VLM x SP = 2 pair runs).
MAX_CASES = 13

ROWS, REFUSAL_ROWS = pairwise(FACTORS, FORBIDDEN, list(REFUSED))
_REFUSAL_KEY = {frozenset(pair): key for pair, key in REFUSED.items()}


def _case_id(k: int, row: dict) -> str:
    flags = [f"{row['model']}", row["strategy"], f"logits-{row['logits']}", f"sp{row['sp']}", row["sharing"]]
    flags += [name for name in ("lora", "fused", "dynamic_bsz", "grad_ckpt", "offload", "critic") if row[name]]
    return f"{k:02d}-" + "-".join(flags)


CASES = ([{"id": _case_id(k, row), "config": row, "refusal": None} for k, row in enumerate(ROWS)]
         + [{"id": _case_id(len(ROWS) + k, row), "config": row, "refusal": _REFUSAL_KEY[frozenset(pair)]}
            for k, (pair, row) in enumerate(REFUSAL_ROWS)])


def test_matrix_covers_every_pair():
    """The cases that run hold every allowed pair and no refused or forbidden pair; each refused pair has its case.
    The size is printed (and bounded)."""
    total = 1
    for levels in FACTORS.values():
        total *= len(levels)
    print(f"\npairwise matrix: {len(ROWS)} cases that run + {len(REFUSAL_ROWS)} refusal cases, of {total} "
          f"combinations of {len(FACTORS)} options")
    assert len(CASES) <= MAX_CASES
    assert not uncovered(ROWS, FACTORS, FORBIDDEN, list(REFUSED))
    banned = {frozenset(p) for p in list(REFUSED) + list(FORBIDDEN)}
    for row in ROWS:
        assert not any(frozenset(((a, va), (b, vb))) in banned for a, va, b, vb in row_pairs(row, FACTORS)), row
    for pair, row in REFUSAL_ROWS:
        assert all(row[f] == v for f, v in pair)
        held = {frozenset(((a, va), (b, vb))) for a, va, b, vb in row_pairs(row, FACTORS)}
        assert held & banned == {frozenset(pair)}, row


def test_refusal_records_exist():
    """Each expected refusal is a record of zorro_verl/refusals.py, so docs/refusals.md lists it."""
    from zorro_verl.refusals import REFUSALS

    keys = {r.key for r in REFUSALS}
    assert set(REFUSED.values()) <= keys, set(REFUSED.values()) - keys


@pytest.mark.parametrize("sharing", ["prompt", "prefix"])
def test_critic_balancing_checks_the_critic_mesh(sharing):
    """The critic cases' no-fallback check is not vacuous: zorro's balancing of the same batch with the critic's
    worker group registered under another mesh name (``"critic"``, which verl 0.9.1's TrainingWorker does not
    register) cannot find the critic's DP size and counts a fallback; under ``"train"`` it reorders without one."""
    from tests.support.verl_matrix import balanced_order, global_rows, training_worker_mesh

    assert training_worker_mesh() == "train"
    base = global_rows("dense", 0, 2)
    order, metrics, meta = balanced_order(base, [0, 1], sharing)
    assert "zorro/balance_fallbacks" not in metrics and metrics["zorro/balance_minibatch_slots"] == 2
    assert sorted(order) == list(range(16)) and any(meta.values())  # the balance stamp
    _, wrong, _ = balanced_order(global_rows("dense", 0, 2), [0, 1], sharing, critic_mesh="critic")
    assert wrong.get("zorro/balance_fallbacks") == 1, wrong


@pytest.fixture(scope="module")
def matrix_results(tiny_ckpt, tmp_path_factory):
    """Every case in one 2-rank gloo group (tests/support/verl_matrix.py): the checkpoints and LoRA adapters of the
    three models are written here, once; returns ``{case id: [rank 0 result, rank 1 result]}`` and the ranks' total
    seconds."""
    from tests.support.multi_rank import run_ranks
    from tests.support.verl_engines import lora_adapter
    from tests.support.verl_vlm import tiny_vlm_checkpoint
    from zorro_verl.testing import tiny_hybrid_model

    root = tmp_path_factory.mktemp("matrix")
    hybrid = root / "qwen3_5"
    model = tiny_hybrid_model("qwen3_5", dtype=torch.float32, seed=0, exact=False)
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(hybrid)
    ckpts = {"dense": tiny_ckpt, "hybrid": str(hybrid), "vlm": tiny_vlm_checkpoint(root / "vlm", VLM_FAMILY)}
    adapters = {m: lora_adapter(c, root / f"lora_{m}", "all-linear", seed=3) for m, c in ckpts.items()}
    spec = root / "spec.json"
    spec.write_text(json.dumps({"ckpts": ckpts, "adapters": adapters, "vlm_family": VLM_FAMILY,
                                "cases": [{"id": c["id"], "config": c["config"]} for c in CASES]}))
    ranks = run_ranks("tests.support.verl_matrix", 2, [spec], root, HANG_TIMEOUT_S)
    print(f"\nmatrix: {len(CASES)} cases, ranks' wall time {max(r['seconds'] for r in ranks):.0f} s")
    return {c["id"]: [r["cases"][k] for r in ranks] for k, c in enumerate(CASES)}


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_case(matrix_results, case):
    from zorro_verl.refusals import REFUSALS

    results = matrix_results[case["id"]]
    cfg = case["config"]
    for r in results:
        print(f"\n{case['id']} rank {r['rank']} ({r['seconds']:.1f} s): "
              + (r["refused"] or json.dumps(r.get("errors"))))
    if case["refusal"] is not None:
        record = next(x for x in REFUSALS if x.key == case["refusal"])
        for r in results:  # every rank raises, with the record's phrase
            assert r["refused"] is not None and record.phrase in r["refused"], (record.phrase, r["refused"])
        return
    from tests.support.verl_engines import assert_steps_match

    for r in results:
        assert r["refused"] is None, r["refused"]
        assert_steps_match(r["errors"], ATOL, RTOL)
        assert r["dedup_ratio"] > 1.0
        # every option took effect in the zorro engine (with fused kernels the logits mode is unused: verl's fused
        # kernel is the head, docs/design/verl.md)
        eff = r["effective"]
        assert {k: eff[k] for k in eff if k != "logits"} == {k: cfg[k] for k in eff if k != "logits"}, (eff, cfg)
        assert eff["logits"] == cfg["logits"]
        # a shared system prompt over different questions: a prefix tree of depth >= 2 under sharing=prefix
        assert (r["tree_depth"] is not None and r["tree_depth"] >= 2) == (cfg["sharing"] == "prefix"), r["tree_depth"]
        if cfg["critic"]:
            for b in r["balance"]:  # zorro's balancing ran with the critic's DP size, no fallback
                assert b["order_is_permutation"] and "zorro/balance_fallbacks" not in b, b
                assert b.get("zorro/balance_minibatch_slots", 0) >= 1, b
            assert r["balance"][0]["order"] == results[0]["balance"][0]["order"]  # every rank the same order
            assert r["balance_hooks_missing"] == [0.0, 0.0]
