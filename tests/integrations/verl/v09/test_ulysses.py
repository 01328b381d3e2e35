"""zorro under verl's Ulysses sequence parallelism (docs/design/verl.md): the zorro engine with SP = 2 against verl's
stock engine with the same SP and against the stock engine without SP, on CPU over gloo (fp32; FSDP2 and FSDP1, in the
same processes, one test per strategy), in one inference pass and one training step (tests/support/verl_ulysses.py
runs each rank).

Cases: SP = 2 in 2 processes on a model with one KV head (kv_heads < SP: repeated) and SP = 2 x DP = 2 in 4
processes (two KV heads); 12 rows of 3 shuffled prompts per DP rank with a 1-token and an empty response, fixed
micro-batches of 3 rows (4-row groups split across micro-batches), packed rows whose length SP does not divide.
Every engine also runs the inference pass with a dynamic token budget. The 2-process run also checks the memory
logits mode (with gradient checkpointing), verl's fused kernels, a long-prompt batch in which one SP rank holds no
response-predicting row (the common case at long context), the refusal of SP ranks with different batches, and hybrid
Qwen3.5 / Qwen3-Next (gated delta-net layers exchanged like attention; Qwen3.5 also with ``sharing=prefix`` on the
agentic batch below) against verl's stock engine without SP, run padded (verl's own SP path for them needs
flash-linear-attention's context-parallel kernels; its CPU remove-padding path is no reference: test_hybrid_engine.py).
Prefix trees (``sharing=prefix``) under SP, in both runs: an agentic batch per DP rank (a shared system prompt over 3
questions x 3 samples, a multi-output 3-turn trajectory with masked tool tokens) against both stock engines, and the
prompt batch as a depth-one tree. The all-to-all bytes are counted per training step and must equal the cost model.

Tolerances (docs/design/testing.md, fp32): log-probs / entropy max abs <= 1e-5; loss, grad norm, gradients relative
<= 1e-5.
"""

import pytest
import torch

from tests.support import HANG_TIMEOUT_S  # a hang guard, never a speed check

pytestmark = pytest.mark.usefixtures("verl_cpu")  # skips without verl 0.9

ATOL = 1e-5
RTOL = 1e-5
#: Seconds the ranks get before the test fails as a hang (a normal run takes well under half of it).


@pytest.fixture(scope="module")
def kv1_ckpt(tmp_path_factory):
    """The tiny Qwen3 of ``tiny_ckpt`` with one KV head (4 query heads): fewer KV heads than SP ranks."""
    from zorro_verl.testing.models import model_from_config, tiny_config

    cfg = tiny_config("qwen3")
    cfg.num_key_value_heads = 1
    path = tmp_path_factory.mktemp("tiny_qwen3_kv1")
    model = model_from_config(cfg, torch.float32, 0, "sdpa")
    model.config.architectures = ["Qwen3ForCausalLM"]
    model.save_pretrained(path)
    return str(path)


#: Worst figures over the ranks, printed in the pytest summary (tests/conftest.py): errors against each stock engine
#: and the all-to-all bytes of a training step (zorro / stock SP) next to the deduplicated token ratio.
SUMMARY: dict = {}


def _record(name: str, results: list) -> None:
    def rel(pair):
        return abs(pair[0] - pair[1]) / abs(pair[0])

    line = {}
    for ref in ("stock_sp", "stock"):
        cs = [r[ref] for r in results]
        line[f"vs {ref}"] = (f"log-prob {max(c['log_probs_max_abs'] for c in cs):.1e}, entropy "
                     f"{max(c['entropy_max_abs'] for c in cs):.1e}, loss rel {max(rel(c['loss']) for c in cs):.1e}, "
                     f"grad-norm rel {max(rel(c['grad_norm']) for c in cs if c['grad_norm']):.1e}, grad rel "
                     f"{max(c['grad_rel'] for c in cs):.1e}")
    # one rank per SP group (the ranks of a group exchange the same volume)
    first = [r for r in results if r["rank"] % 2 == 0]
    bz, bs = (sum(r["a2a_bytes"][k] for r in first) for k in ("zorro_sp", "stock_sp"))
    tz, ts = (sum(r[k] for r in first) for k in ("dedup_tokens", "ordinary_tokens"))
    line["all-to-all"] = (f"zorro / stock SP bytes per training step {bz} / {bs} = {bz / bs:.3f}; tokens "
                          f"{tz} / {ts} = {tz / ts:.3f}")
    cs = [r["tree"]["stock_sp"] for r in results]
    line["tree vs stock_sp"] = (f"log-prob {max(c['log_probs_max_abs'] for c in cs):.1e}, entropy "
                                f"{max(c['entropy_max_abs'] for c in cs):.1e}, loss rel "
                                f"{max(rel(c['loss']) for c in cs):.1e}, grad rel {max(c['grad_rel'] for c in cs):.1e}")
    bz, bs = (sum(r["tree"]["a2a_bytes"][k] for r in first) for k in ("zorro_sp", "stock_sp"))
    tz, ts = (sum(sum(r["tree"]["plan_tokens"]) for r in first), sum(r["tree"]["ordinary_tokens"] for r in first))
    line["tree all-to-all"] = (f"zorro / stock SP bytes per training step {bz} / {bs} = {bz / bs:.3f}; tokens "
                               f"{tz} / {ts} = {tz / ts:.3f}")
    SUMMARY[name] = line


def _check_equal(cmp: dict) -> None:
    assert cmp["fallback"] == [0.0]
    assert cmp["log_probs_max"] > 1.0  # a real comparison, not zeros
    assert cmp["log_probs_max_abs"] <= ATOL and cmp["entropy_max_abs"] <= ATOL
    assert cmp["log_probs_dynamic_bsz_max_abs"] <= ATOL
    la, lb = cmp["loss"]
    assert abs(la) > 1e-4 and abs(la - lb) <= RTOL * abs(la)
    if cmp["grad_norm"] is not None:  # verl reports it on the first rank of each SP group
        ga, gb = cmp["grad_norm"]
        assert ga > 1e-5 and abs(ga - gb) <= RTOL * ga
    assert cmp["grad_rel"] <= RTOL


def _check_bytes(r: dict, sp: int) -> None:
    """Each engine hands all_to_all exactly the cost model's bytes: per attention layer, forward and backward,
    ``(2 Hq + 2 Hkv') * L * D * 4`` with ``L = ceil(tokens / sp)`` of each micro-batch's packed row (zorro: each
    prompt once; stock: every row whole)."""
    from zorro_verl.attention.ulysses import all_to_all_bytes

    def expected(tokens):
        return sum(2 * r["layers"] * all_to_all_bytes(-(-t // sp), sp, r["heads"], r["kv_heads"], r["head_dim"], 4)
                   for t in tokens)

    assert sum(r["zorro_mb_tokens"]) == r["dedup_tokens"]
    assert r["a2a_bytes"]["zorro_sp"] == expected(r["zorro_mb_tokens"])
    assert r["a2a_bytes"]["stock_sp"] == expected(r["stock_mb_tokens"])
    assert r["a2a_bytes"]["stock"] == 0
    assert r["a2a_bytes"]["zorro_sp"] < r["a2a_bytes"]["stock_sp"]


def _check_tree(r: dict, sp: int) -> None:
    """Prefix trees under SP: equal to both stock engines; bytes = the cost model over the trees' packed rows."""
    from zorro_verl.attention.ulysses import all_to_all_bytes

    t = r["tree"]
    assert t["fallback"] == [0.0] and t["depth"] >= 3
    for ref in ("stock_sp", "stock", "depth_one_vs_stock_sp"):
        _check_equal(t[ref])

    def expected(tokens):
        return sum(2 * r["layers"] * all_to_all_bytes(-(-n // sp), sp, r["heads"], r["kv_heads"], r["head_dim"], 4)
                   for n in tokens)

    assert t["a2a_bytes"]["zorro_sp"] == expected(t["plan_tokens"])
    assert t["a2a_bytes"]["stock_sp"] == expected(t["stock_mb_tokens"])
    assert sum(t["plan_tokens"]) < t["ordinary_tokens"] and t["a2a_bytes"]["zorro_sp"] < t["a2a_bytes"]["stock_sp"]


def _check_common(results: list, sp: int) -> None:
    # the same micro-batch counts on every rank of the DP x SP mesh
    assert len({r["micro_batches"] for r in results}) == 1
    assert len({len(r["zorro_dyn_mb_tokens"]) for r in results}) == 1
    for r in results:
        assert 0 in r["response_lens"] and 1 in r["response_lens"]
        assert r["split_groups"] > 0  # a group split across micro-batches
        assert any(t % sp for t in r["zorro_mb_tokens"])  # a packed row SP does not divide
        assert r["fallback"] == [0.0]
        # dynamic batch size: the budget is per SP group, each prompt counted once
        assert len(r["zorro_dyn_mb_tokens"]) > 1 and max(r["zorro_dyn_mb_tokens"]) <= r["dyn_budget"]
        for ref in ("stock_sp", "stock"):
            _check_equal(r[ref])
        assert r["stock_sp_vs_stock_log_probs_max_abs"] <= ATOL
        _check_bytes(r, sp)
        _check_tree(r, sp)
    first = [r for r in results if r["rank"] % sp == 0]
    assert first and all(r["stock"]["grad_norm"] is not None for r in first)


@pytest.fixture(scope="module")
def sp2_results(kv1_ckpt, tmp_path_factory):
    """SP = 2 in 2 processes (one SP group), both strategies."""
    from tests.support.multi_rank import run_ranks

    return run_ranks("tests.support.verl_ulysses", 2, [kv1_ckpt, 2], tmp_path_factory.mktemp("sp2"), HANG_TIMEOUT_S)


@pytest.fixture(scope="module")
def sp2_dp2_results(tiny_ckpt, tmp_path_factory):
    """SP = 2 x DP = 2 in 4 processes, both strategies."""
    from tests.support.multi_rank import run_ranks

    return run_ranks("tests.support.verl_ulysses", 4, [tiny_ckpt, 2], tmp_path_factory.mktemp("sp2_dp2"),
                     HANG_TIMEOUT_S)


def test_sp2_matches_stock_kv_heads_below_sp(sp2_results, strategy):
    results = [r[strategy] for r in sp2_results]
    assert results[0]["kv_heads"] == 1
    _record(f"SP=2 (kv_heads=1), {strategy}", results)
    _check_common(results, 2)
    for r in results:
        _check_equal(r["stock_sp"]["memory"])  # with gradient checkpointing
        _check_equal(r["stock_sp"]["fused"])
        _check_equal(r["stock_sp"]["head_rows_on_one_rank"])
        assert r["head_rows_per_rank"][0] == 0  # SP rank 0 computes no head row there
    for r in sp2_results:  # checked once, under FSDP2: they do not depend on the strategy
        ref = r["fsdp2"]["refusals"]
        assert "hold different batches" in ref["mismatch"]
        assert set(r["fsdp2"]["hybrid"]) == {"qwen3_5", "qwen3_next", "qwen3_5_prefix"}
        for kind, h in r["fsdp2"]["hybrid"].items():  # gated delta-net layers under SP (FSDP2), also with a tree
            _check_hybrid(kind, h)


def _check_hybrid(kind: str, h: dict) -> None:
    """Hybrid models under SP vs stock without SP (padded): fp32 tolerances; bytes = attention layers' cost model +
    the delta-net layers' (:func:`~zorro_verl.attention.ulysses.linear_attention_all_to_all_bytes`)."""
    from zorro_verl.attention.ulysses import all_to_all_bytes, linear_attention_all_to_all_bytes

    assert h["fallback"] == [0.0], kind
    for key in ("log_probs", "entropy"):
        assert h[f"{key}_scale"] > 0.1 and h[f"{key}_max_abs"] <= ATOL, (kind, key, h)
    la, lb = h["loss"]
    assert abs(la) > 1e-4 and abs(la - lb) <= RTOL * abs(la), (kind, h["loss"])
    if h["grad_norm"] is not None:
        ga, gb = h["grad_norm"]
        assert ga > 1e-4 and abs(ga - gb) <= RTOL * ga, (kind, h["grad_norm"])
    assert h["grad_rel"] <= RTOL, (kind, h["grad_rel"])
    s = h["shape"]
    sp, types = s["sp"], s["layer_types"]
    n_attn, n_lin = types.count("full_attention"), types.count("linear_attention")
    def expected(tokens):
        return sum(2 * (n_attn * all_to_all_bytes(-(-t // sp), sp, s["heads"], s["kv_heads"], s["head_dim"], 4)
                        + n_lin * linear_attention_all_to_all_bytes(-(-t // sp), sp, s["k_heads"], s["v_heads"],
                                                                     s["k_dim"], s["v_dim"], 4, 4))
                   for t in tokens)

    assert h["a2a_bytes"] == expected(h["mb_tokens"]), (kind, h["a2a_bytes"], expected(h["mb_tokens"]))
    # stock has no head-exchange SP path for these models: the same cost model on its micro-batches, for reference
    stock = expected(h["stock_mb_tokens"])
    assert h["a2a_bytes"] < stock
    tz, ts = sum(h["mb_tokens"]), sum(h["stock_mb_tokens"])
    SUMMARY.setdefault("hybrid SP=2 (FSDP2)", {})[kind] = (
        f"log-prob {h['log_probs_max_abs']:.1e}, entropy {h['entropy_max_abs']:.1e}, loss rel "
        f"{abs(la - lb) / abs(la):.1e}, grad rel {h['grad_rel']:.1e}; all-to-all bytes per training step "
        f"{h['a2a_bytes']} / {stock} (cost model on stock's micro-batches) = {h['a2a_bytes'] / stock:.3f}; tokens "
        f"{tz} / {ts} = {tz / ts:.3f}")


def test_sp2_dp2_matches_stock(sp2_dp2_results, strategy):
    results = [r[strategy] for r in sp2_dp2_results]
    assert results[0]["kv_heads"] == 2
    _record(f"SP=2 x DP=2, {strategy}", results)
    _check_common(results, 2)
    # the two SP groups hold different batches
    assert results[0]["zorro_mb_tokens"] != results[2]["zorro_mb_tokens"]
