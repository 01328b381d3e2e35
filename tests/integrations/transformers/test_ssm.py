"""State-space models, ZoRRo vs the ordinary per-row forward: Mamba-2 — Mamba2 (pure), Bamba, Granite 4 hybrid
(granitemoehybrid), Nemotron-H (hybrids with attention) — and Mamba v1 — Mamba, FalconMamba (pure), Jamba (hybrid).

Tolerances:

* fp64 (``exact_fp64_ssm`` oracle: the family's per-row forward with the scan, norms and logits kept in fp64, the same
  scan kernel as zorro's): log-probs / entropy within ``1e-12`` absolute (measured 1.8e-15 / 3.6e-15);
  gradients per parameter ``max|Δ|/max|ref| <= 1e-12`` (measured <= 3.3e-15; zorro chunks the scan differently — a
  prompt and each response are separate kernel sequences — so they differ by rounding only).
* fp32 with the stock transformers forward (its own torch SSD / sequential-scan path, no swaps): zorro's error vs the
  fp64 oracle must be at most 2x (log-probs, entropy) / 3x (gradients) the error of the ordinary fp32 forward vs the
  same oracle (docs/design/testing.md).
"""

import contextlib
import copy
import sys

import pytest
import torch

from tests.recurrent.test_recurrent import _batch
from tests.support import mamba_ssm_cpu
from tests.support.recurrent_checks import (
    GRAD_REL_TOL,
    LP_ABS_TOL,
    assert_exact_fp64,
    assert_relative_rule,
    grads,
    one_thread,
    oracle,
)
from zorro_verl.integrations.transformers import (
    LayerCalls,
    expected_layer_calls,
    install_zorro,
    is_installed,
    ssm,
    uninstall_zorro,
    zorro_step,
)
from zorro_verl.packing import build_plan
from zorro_verl.testing import (
    SSM_KINDS,
    batch_from_rows,
    exact_fp64_ssm,
    max_rel_grad_error,
    ordinary_logprobs,
    shared_system_rows,
    tiny_model,
    tiny_ssm_model,
)
from zorro_verl.testing.fp64 import KeepFp64

_one_thread = pytest.fixture(autouse=True)(one_thread)
_grads, _oracle = grads, oracle



CASES = {
    # B, G, P, R: interleaved siblings, 1-token and empty responses (create_dummy_batch add_padding + shuffle)
    "mixed": dict(B=6, G=2, P=11, R=7),
    "short_prompts": dict(B=5, G=2, P=2, R=5),  # prompts shorter than the conv context (zeros before them)
    "long": dict(B=3, G=1, P=70, R=66),  # prompts and responses cross many 8-token scan chunks
}


@pytest.mark.parametrize("kind,case", [(k, "mixed") for k in SSM_KINDS] + [("bamba", "short_prompts"),
                                                                          ("mamba2", "long"),
                                                                          ("falcon_mamba", "short_prompts")])
def test_zorro_equals_ordinary_fp64(kind, case):
    c = CASES[case]
    batch = _batch(B=c["B"], G=c["G"], P=c["P"], R=c["R"], seed=11)
    R = c["R"]
    model = tiny_ssm_model(kind, seed=1)
    model.train()
    lp_ref, ent_ref, g_ref = _oracle(model, batch, R)
    install_zorro(model)
    plan = build_plan(batch["input_ids"], batch["attention_mask"], R, position_ids=batch["position_ids"])
    assert plan.N == lp_ref.numel() and plan.T < plan.ordinary_tokens
    calls = LayerCalls()
    assert_exact_fp64(model, plan, lp_ref, ent_ref, g_ref, calls)
    attn, rec = expected_layer_calls(model)
    assert calls.recurrent == rec == 2
    assert calls.attention == attn == (0 if kind in ("mamba2", "mamba", "falcon_mamba") else 1)
    assert not calls.fallbacks


@pytest.mark.parametrize("kind", ["bamba", "mamba2", "jamba", "zamba2", "zamba", "falcon_h1"])
def test_prefix_tree_carries_state_down_the_trie_fp64(kind):
    """sharing='prefix': a shared system prompt over two questions, a branching rollout (nodes at depth 3) and
    nodes shorter than the conv context, vs the ordinary per-row forward. The scan state runs from each node's
    parent's final state; each node's conv context spans its ancestors."""
    from tests.attention.test_tree_backends import branching_rows

    rows = shared_system_rows(2, 2, system_len=9, question_len=2, response_len=5, vocab_size=100, seed=5)
    rows += branching_rows(depth=3, width=2, turn=2, seed=6)  # 2-token nodes: the conv context spans ancestors
    batch = batch_from_rows(rows)
    R = batch["responses"].shape[1]
    model = tiny_ssm_model(kind, seed=1)
    model.train()
    with _fp64(kind):
        lp_ref, ent_ref, g_ref = _oracle(model, batch, R)
        install_zorro(model)
        plan = build_plan(batch["input_ids"], batch["attention_mask"], R, sharing="prefix", min_shared_len=1)
        assert plan.tree.levels == 4 and min(plan.tree.node_len.tolist()) < 3
        assert_exact_fp64(model, plan, lp_ref, ent_ref, g_ref)


@pytest.mark.parametrize("kind", ["bamba", "nemotron_h", "zamba2"])
def test_gradient_checkpointing_fp64(kind):
    """Checkpointed layers re-run the wrapped forward: Bamba's layers pass the context kwarg to the mixer, Nemotron-H's
    layer carrier hands it over again on the recompute. Same values and gradients."""
    batch = _batch(B=4, G=2, P=6, R=4, seed=2)
    plan = build_plan(batch["input_ids"], batch["attention_mask"], 4)
    model = tiny_ssm_model(kind, seed=2)
    model.train()
    install_zorro(model)
    lp0, ent0 = zorro_step(model, plan, calculate_entropy=True)
    g0 = _grads(model, lp0, ent0)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lp, ent = zorro_step(model, plan, calculate_entropy=True)
    g1 = _grads(model, lp, ent)
    assert (lp - lp0).abs().max().item() == 0 and (ent - ent0).abs().max().item() == 0
    assert max_rel_grad_error(g0, g1)[0] < 1e-14


@pytest.mark.parametrize("kind", ["mamba2", "falcon_h1"])
def test_gradient_checkpointing_refused_where_only_the_root_gets_the_context(kind):
    """Mamba2's backbone and Falcon-H1's model pass no kwargs to their layers: a recomputed layer could not find its
    plan — refused."""
    batch = _batch(B=3, G=1, P=5, R=3)
    model = tiny_ssm_model(kind, seed=0)
    model.train()
    install_zorro(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with pytest.raises(ValueError, match="whose model does not pass zorro's step context"):
        zorro_step(model, build_plan(batch["input_ids"], batch["attention_mask"], 3))


def _fused_scan_on_cpu(monkeypatch, model):
    """Where transformers puts mamba-ssm's scan (the mixer module's ``mamba_chunk_scan_combined``), the CPU stand-in;
    and the stock mixer's fused-path decision (CUDA with mamba-ssm and causal-conv1d) made true on this CPU."""
    mod = sys.modules[type(ssm.mamba_modules(model)[0][2]).__module__]
    monkeypatch.setattr(mod, "mamba_chunk_scan_combined", mamba_ssm_cpu.mamba_chunk_scan_combined, raising=False)
    monkeypatch.setattr(ssm, "stock_runs_fused", lambda m, h: True)
    mamba_ssm_cpu.CALLS.clear()


@pytest.mark.parametrize("kind,groups", [("mamba2", 1), ("bamba", 1), ("falcon_h1", 2)])
def test_fused_scan_path_fp64(kind, groups, monkeypatch):
    """Where the stock mixer runs its fused path, zorro's Mamba-2 scan runs mamba-ssm's ``mamba_chunk_scan_combined``
    as the model's module loaded it (here the CPU stand-in, tests/support/mamba_ssm_cpu.py): per layer one call for
    the prompts (with their final states) and one for the responses (from them); values and every gradient equal the
    ordinary per-row forward; nothing counted as a fallback. ``n_groups = 1`` for Mamba2 / Bamba (with more groups
    their fused norm is grouped: refused by name, below); Falcon-H1 (no gated norm) with 2 groups."""
    batch = _batch(B=6, G=2, P=11, R=7, seed=11)
    model = tiny_ssm_model(kind, seed=1, groups=groups)
    model.train()
    lp_ref, ent_ref, g_ref = _oracle(model, batch, 7)
    _fused_scan_on_cpu(monkeypatch, model)
    install_zorro(model)  # its probe runs the fused path too
    plan = build_plan(batch["input_ids"], batch["attention_mask"], 7, position_ids=batch["position_ids"])
    calls = LayerCalls()
    mamba_ssm_cpu.CALLS.clear()
    assert_exact_fp64(model, plan, lp_ref, ent_ref, g_ref, calls)
    assert not calls.fallbacks and calls.recurrent == 2
    log = mamba_ssm_cpu.CALLS
    assert [(c["initial_states"], c["final"], c["batch"]) for c in log] == [(False, True, plan.G),
                                                                          (True, False, plan.B)] * 2
    assert all(c["x"] == c["B"] == c["dt"] == torch.float64 for c in log)


def test_fused_scan_path_keeps_the_model_dtype(monkeypatch):
    """bf16 model: the fused kernel gets ``x`` / ``B`` / ``C`` in bf16 (no fp32 copies of the row) and the step size in
    fp32 (softplus and clamp in fp32, as mamba-ssm's kernel computes them)."""
    batch = _batch(B=4, G=2, P=9, R=5, seed=3)
    model = tiny_ssm_model("bamba", dtype=torch.bfloat16, seed=1, exact=False, groups=1)
    model.train()
    _fused_scan_on_cpu(monkeypatch, model)
    install_zorro(model)
    lp, _ = zorro_step(model, build_plan(batch["input_ids"], batch["attention_mask"], 5))
    assert torch.isfinite(lp).all() and lp.dtype == torch.float32
    assert mamba_ssm_cpu.CALLS and all(c["x"] == c["B"] == torch.bfloat16 and c["dt"] == torch.float32
                                       for c in mamba_ssm_cpu.CALLS)


def test_fused_path_with_grouped_norm_is_refused(monkeypatch):
    """Mamba2 with ``n_groups = 2`` where the stock mixer runs fused: its fused norm is grouped, the torch norm zorro
    calls is not — refused by name."""
    batch = _batch(B=3, G=1, P=5, R=3)
    model = tiny_ssm_model("mamba2", seed=0, groups=2)
    _fused_scan_on_cpu(monkeypatch, model)
    with pytest.raises(ValueError, match="n_groups = 2 on CUDA with mamba-ssm"):  # at install, by its probe
        install_zorro(model)
    uninstall_zorro(model)
    monkeypatch.setattr(ssm, "stock_runs_fused", lambda m, h: False)  # the torch path: runs
    install_zorro(model)
    lp, _ = zorro_step(model, build_plan(batch["input_ids"], batch["attention_mask"], 3))
    assert torch.isfinite(lp).all()


# ---------------------------------------------------------------------------------------------------- fp32
@pytest.mark.parametrize("kind", [*SSM_KINDS, "zamba2", "falcon_h1", "falcon_h1_norm"])
def test_zorro_fp32_stock_forward(kind):
    """fp32, transformers' own torch path (its chunked SSD, norms, casts; no swaps) — what runs on a CPU host."""
    # ~80 response tokens: the 2x rule compares two maxima of rounding noise, which over fewer tokens scatter
    # (measured on 30 tokens: FalconMamba's ratio 0.9x to 2.5x over seeds, with zorro's scan rounding as the stock one)
    batch = _batch(B=8, G=2, P=10, R=12, seed=4)
    R = 12
    m32 = tiny_ssm_model(kind, dtype=torch.float32, seed=3, exact=False)
    m64 = copy.deepcopy(m32).to(torch.float64)
    exact_fp64_ssm(m64)
    for m in (m32, m64):
        m.train()
    assert_relative_rule(m32, m64, batch, R)


# ---------------------------------------------------------------------------------------------------- install / errors
def test_install_wraps_instances_and_uninstall_restores():
    model = tiny_ssm_model("nemotron_h", seed=4)
    batch = _batch(B=3, G=1, P=5, R=3)
    before, _ = ordinary_logprobs(model, batch["input_ids"], batch["attention_mask"], 3)
    mods = ssm.mamba_modules(model)
    saved = [m.__dict__["forward"] for _, _, m in mods]  # the exact oracle's instance forward
    root_saved = model.__dict__["forward"]
    assert [i for i, _, _ in mods] == [0, 3] and expected_layer_calls(model) == (1, 2)
    keys = list(model.state_dict())
    install_zorro(model)
    install_zorro(model)  # idempotent
    assert is_installed(model) and all(ssm.is_wrapped(m) and ssm.is_wrapped(lay) for _, lay, m in mods)
    assert list(model.state_dict()) == keys  # the carriers hold their mixer without registering it again
    cls = type(mods[0][2])
    assert cls.forward.__name__ == "forward"  # class untouched
    with pytest.raises(ValueError, match="without zorro's step context"):
        mods[0][2](torch.zeros(1, 3, 32, dtype=torch.float64))
    uninstall_zorro(model)
    assert not is_installed(model) and not any(ssm.is_wrapped(m) or ssm.is_wrapped(lay) for _, lay, m in mods)
    assert all(m.__dict__["forward"] is f for (_, _, m), f in zip(mods, saved))
    assert model.__dict__["forward"] is root_saved and "forward" not in mods[0][1].__dict__
    after, _ = ordinary_logprobs(model, batch["input_ids"], batch["attention_mask"], 3)
    assert torch.equal(before, after)


def test_unknown_mamba_mixer_refused_by_name():
    model = tiny_ssm_model("bamba", seed=0)
    prev = model.config._attn_implementation
    del model.model.layers[2].mamba.D  # no longer a Mamba-2 mixer zorro knows
    with pytest.raises(ValueError, match=r"is not a Mamba-2 mixer zorro knows \(missing \['D'\]"):
        install_zorro(model)
    assert model.config._attn_implementation == prev and not ssm.is_wrapped(model.model.layers[0].mamba)


def test_unknown_hybrid_layer_refused_by_name():
    model = tiny_ssm_model("zamba2", seed=0)
    del model.model.layers[2].shared_transformer  # no longer a shared block feeding a Mamba-2 layer
    with pytest.raises(ValueError, match=r"hybrid layer 2 \(Zamba2HybridLayer\) is not a hybrid layer zorro knows"):
        install_zorro(model)
    assert not is_installed(model) and not ssm.is_wrapped(model.model.layers[0].mamba)


def _fp64(kind):
    """Zamba's mixer computes its decay from ``A_log.float()``: the oracle keeps fp64 under :class:`KeepFp64`."""
    return KeepFp64() if kind == "zamba" else contextlib.nullcontext()


@pytest.mark.parametrize("kind", ["zamba2", "zamba", "falcon_h1", "falcon_h1_norm"])
def test_hybrid_layers_fp64(kind):
    """``hybrid`` layers vs the ordinary per-row forward, 2 B / C groups. Zamba2 (mamba, hybrid, hybrid): each hybrid
    layer runs the one shared attention block (input [h | embeddings], rotary positions, its own LoRA adapters on
    q / k / v) through zorro's attention, then its Mamba-2 layer (grouped gated norm, step size clamped at
    time_step_min as its torch path does). Falcon-H1 (hybrid, hybrid): attention and a Mamba-2 mixer side by side on
    the same input, every muP multiplier away from 1 (the mixer's ssm_in_multiplier and mup_vector included); its
    output y * silu(gate), or (falcon_h1_norm) its grouped norm with the gate after it. Zamba (mamba, mamba, hybrid):
    multi-head Mamba v1 mixers (2 heads, each with its own x_proj / dt_proj and so its own B / C)."""
    batch = _batch(B=6, G=2, P=11, R=7, seed=11)
    model = tiny_ssm_model(kind, seed=1)
    model.train()
    mods = ssm.mamba_modules(model)
    n_mamba = 3 if kind.startswith("zamba") else 2
    assert len(mods) == n_mamba
    assert mods[-1][2].n_mamba_heads == 2 if kind == "zamba" else mods[-1][2].n_groups == 2
    if kind == "zamba2":  # one block, run by both hybrid layers
        assert model.model.layers[1].shared_transformer is model.model.layers[2].shared_transformer
    elif kind.startswith("falcon_h1"):
        assert torch.unique(mods[0][2].mup_vector).numel() == 5 and mods[0][2].ssm_in_multiplier != 1
    with _fp64(kind):
        lp_ref, ent_ref, g_ref = _oracle(model, batch, 7)
        install_zorro(model)
        plan = build_plan(batch["input_ids"], batch["attention_mask"], 7, position_ids=batch["position_ids"])
        assert plan.T < plan.ordinary_tokens
        calls = LayerCalls()
        assert_exact_fp64(model, plan, lp_ref, ent_ref, g_ref, calls)
    n_attn = 1 if kind == "zamba" else 2
    assert (calls.attention, calls.recurrent) == expected_layer_calls(model) == (n_attn, n_mamba)
    assert not calls.fallbacks


def test_sp2_mamba2_fp64(tmp_path):
    """Mamba-2 under Ulysses SP = 2 (two processes over gloo, tests/support/ulysses_step.py): each rank runs the conv
    and the scan of its heads over the whole deduplicated row; Bamba with 2 B / C groups (one per rank), Mamba2 with 1
    (repeated per head before the exchange), Bamba with a prefix tree, the hybrid layers of Zamba2 and Falcon-H1 (2
    groups); logits modes none and memory (Falcon-H1 scales its logits: none only). SP vs the same plan without SP
    <= 1e-12 (relative, Frobenius); vs the ordinary per-row forward: log-probs / entropy <= 1e-12 abs, every gradient
    <= 1e-12 relative."""
    from tests.support import HANG_TIMEOUT_S
    from tests.support.multi_rank import run_ranks

    for r in run_ranks("tests.support.ulysses_step", 2, ["cpu", "ssm"], tmp_path, HANG_TIMEOUT_S):
        cases = ("bamba_g2", "mamba2_g1", "bamba_tree", "zamba2_g2", "falcon_h1_g2")
        assert set(r) >= set(cases) and r["bamba_tree"]["tree"]
        for case in cases:
            for mode in ("none",) if case == "falcon_h1_g2" else ("none", "memory"):
                err, orc = r[case][mode]["sp_vs_ref"], r[case][mode]["sp_vs_oracle"]
                assert max(err["log_probs"], err["entropy"], err["grads"]) <= 1e-12, (case, mode, err)
                assert max(orc["log_probs_max_abs"], orc["entropy_max_abs"]) <= LP_ABS_TOL, (case, mode, orc)
                assert orc["grad_per_param"] <= GRAD_REL_TOL, (case, mode, orc)


def test_ulysses_refusals_by_name():
    """Mamba v1 layers, and Mamba-2 heads SP does not divide, are refused (the FSDP engine asks at initialisation)."""
    assert ssm.mamba_sp_unsupported(tiny_ssm_model("bamba", seed=0), 2) is None  # 4 heads
    assert "must divide the Mamba-2 heads (num_heads = 4)" in ssm.mamba_sp_unsupported(
        tiny_ssm_model("bamba", seed=0), 8)
    assert "Mamba (v1) layers under Ulysses sequence parallelism" in ssm.mamba_sp_unsupported(
        tiny_ssm_model("jamba", seed=0), 2)
    assert "Mamba (v1) layers under Ulysses sequence parallelism" in ssm.mamba_sp_unsupported(
        tiny_ssm_model("zamba", seed=0), 2)  # Zamba's multi-head Mamba v1
    assert ssm.mamba_sp_unsupported(tiny_model(), 2) is None  # no mamba layers: nothing to refuse


def test_nemotron_h_torch_path_is_chunk_dependent_so_long_rows_are_refused():
    """transformers' torch path of Nemotron-H's (and Zamba2's) mixer changes with its chunk size on a 20-token row
    (Bamba's, the same recurrence, does not): it is not the Mamba-2 recurrence across chunks. zorro computes the
    recurrence, so without the fused kernels it refuses rows longer than one chunk (and is exact within one, tests
    above)."""
    h = torch.randn(2, 20, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    spread = {}
    for kind in ("nemotron_h", "zamba2", "bamba"):
        m = tiny_ssm_model(kind, seed=3, exact=False)
        mix = ssm.mamba_modules(m)[0][2]
        outs = []
        for chunk in (8, 40):
            mix.chunk_size = chunk
            outs.append(mix.torch_forward(h))
        spread[kind] = (outs[0] - outs[1]).abs().max().item()
    assert spread["bamba"] < 1e-6 < 1e-5 < min(spread["nemotron_h"], spread["zamba2"]), spread
    batch = _batch(B=2, G=1, P=20, R=14)
    for kind in ("nemotron_h", "zamba2"):
        model = tiny_ssm_model(kind, seed=0)  # chunk_size 32
        install_zorro(model)
        with pytest.raises(ValueError, match="crosses one, so no deduplicated forward can equal"):
            zorro_step(model, build_plan(batch["input_ids"], batch["attention_mask"], 14))


def test_fused_path_with_grouped_norm_refused_where_the_torch_norm_is_not_grouped():
    """On CUDA with mamba-ssm the stock mixer runs mamba_split_conv1d_scan_combined, whose gated norm is per group of
    intermediate / n_groups channels; the torch path's norm module (which zorro runs) is grouped only for Nemotron-H.
    The check (called on that path) refuses the others with n_groups > 1."""
    for kind, groups, refused in (("bamba", 2, True), ("bamba", 1, False), ("mamba2", 2, True),
                                  ("nemotron_h", 2, False)):
        mix = ssm.mamba_modules(tiny_ssm_model(kind, seed=0, groups=groups))[0][2]
        reason = ssm.fused_path_unsupported(mix)
        assert (reason is not None) == refused, (kind, groups, reason)
        if refused:
            assert "normalises the scan output per group" in reason


# ---------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ("mamba2", "bamba"))
def test_gpu_mamba_ssm_bf16_relative_rule(kind):
    """bf16 on CUDA with mamba-ssm and causal-conv1d installed: the stock mixer runs its fused path (in training
    mamba-ssm's ``mamba_split_conv1d_scan_combined``), zorro the same library's ``mamba_chunk_scan_combined`` from
    each prompt's final state; nothing counted as a fallback, and zorro's error vs the fp64 oracle <= 2x (log-probs) /
    3x (grads) that of the stock bf16 forward."""
    pytest.importorskip("mamba_ssm", reason="mamba-ssm is not installed here (its fused kernels are the subject)")
    pytest.importorskip("causal_conv1d", reason="causal-conv1d is not installed here")
    batch = {k: v.cuda() for k, v in _batch(B=8, G=2, P=150, R=90, seed=6).items()}
    R = 90
    # Triton tiles: head dim 32, state 16, 32-token chunks (prompts and responses cross several)
    m16 = tiny_ssm_model(kind, dtype=torch.float32, seed=5, exact=False, groups=1, hidden=64, ssm_head_dim=32,
                         state=16, chunk=32).to("cuda", torch.bfloat16)
    m64 = copy.deepcopy(m16).to(torch.float64)
    exact_fp64_ssm(m64)
    mixer = ssm.mamba_modules(m16)[0][2]
    if not ssm.stock_runs_fused(mixer, torch.zeros(1, device="cuda")):
        pytest.skip("transformers did not load mamba-ssm's fused path for this family here")
    for m in (m16, m64):
        m.train()
    lp64, _, g64 = _oracle(m64, batch, R)
    lp_o, _, g_o = _oracle(m16, batch, R)
    install_zorro(m16)
    calls = LayerCalls()
    lp_z, ent_z = zorro_step(m16, build_plan(batch["input_ids"], batch["attention_mask"], R), calculate_entropy=True,
                             calls=calls)
    g_z = _grads(m16, lp_z, ent_z)
    assert "mamba-ssm" not in calls.fallbacks and "causal-conv1d" not in calls.fallbacks, calls.fallbacks
    up = lambda g: {n: t.double() for n, t in g.items()}  # noqa: E731
    ref_lp, z_lp = (lp_o.double() - lp64).abs().max().item(), (lp_z.double() - lp64).abs().max().item()
    ref_g, z_g = max_rel_grad_error(g64, up(g_o))[0], max_rel_grad_error(g64, up(g_z))[0]
    print(f"{kind} bf16 mamba-ssm: log-probs zorro {z_lp:.3g} vs stock {ref_lp:.3g}; grads {z_g:.3g} vs {ref_g:.3g}")
    assert z_lp <= 2 * ref_lp and z_g <= 3 * ref_g, (z_lp, ref_lp, z_g, ref_g)
