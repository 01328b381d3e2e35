"""GPU backends (flash gather, flash copy-free, flex) in bf16 vs an fp64 reference, by the relative rule of
docs/design/testing.md:
the backend's error vs fp64 must be at most 2x the error of the reference backend run in bf16 (3x for gradients).
Errors are relative Frobenius norms ``|x - x64| / |x64|``. Skipped without CUDA (tests/conftest.py)."""

import pytest
import torch

from tests.attention.test_backends import dense_oracle

pytestmark = pytest.mark.gpu

CUDA = torch.cuda.is_available()


def _available(backend: str) -> bool:
    from zorro_verl.attention import get_backend

    return CUDA and get_backend(backend).available(torch.device("cuda"))


BACKENDS = [pytest.param(b, marks=pytest.mark.skipif(not _available(b), reason=f"{b}: no kernels on this machine"))
            for b in ("flash", "flash_copyfree", "flex")]


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).norm() / ref.norm()).item()


def _batch(B=8, G=3, P=160, R=48, seed=0):
    from zorro_verl.testing import create_dummy_batch

    return create_dummy_batch(B, G, P, R, device="cuda", add_padding=True, shuffle=True, seed=seed)


def _run(backend, plan, q, k, v, w, scaling):
    from zorro_verl.attention import attend

    q, k, v = (x.detach().requires_grad_(True) for x in (q, k, v))
    out = attend(plan, backend, q, k, v, scaling)
    grads = torch.autograd.grad((out.float() * w).sum(), (q, k, v))
    return (out, *grads)


def _tree_batch():
    """Agentic shape for the prefix-tree plan: a shared system prompt over 3 questions x 3 samples, plus a 3-turn
    trajectory emitted as 3 samples (nested prompts)."""
    from zorro_verl.testing import batch_from_rows, multi_turn_rows, shared_system_rows

    rows = shared_system_rows(3, 3, system_len=120, question_len=24, response_len=40, seed=3)
    turns, masks = multi_turn_rows(3, first_prompt_len=64, turn_len=24, observation_len=16, seed=4)
    b = batch_from_rows(rows + turns, response_masks=[[1] * len(r) for _, r in rows] + masks)
    return {k: v.cuda() for k, v in b.items()}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("hq,hkv,d", [(8, 2, 64), (16, 8, 128)])
@pytest.mark.parametrize("sharing", ["prompt", "prefix"])
def test_attention_bf16_vs_fp64_relative_rule(backend, hq, hkv, d, sharing):
    from zorro_verl.packing import build_plan

    b = _batch() if sharing == "prompt" else _tree_batch()
    plan = build_plan(b["input_ids"], b["attention_mask"], b["responses"].shape[1], sharing=sharing)
    assert sharing == "prompt" or plan.tree.levels >= 3
    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda h: torch.randn(1, h, plan.T, d, device="cuda", dtype=torch.float64, generator=g)  # noqa: E731
    q64, k64, v64 = mk(hq), mk(hkv), mk(hkv)
    w = torch.randn(1, plan.T, hq, d, device="cuda", generator=g)
    scaling = d ** -0.5
    qs = [x.clone().requires_grad_(True) for x in (q64, k64, v64)]
    ref_out = dense_oracle(plan, *qs, scaling)
    ref = (ref_out, *torch.autograd.grad((ref_out * w.double()).sum(), qs))
    bf = [x.to(torch.bfloat16) for x in (q64, k64, v64)]
    base = _run("sdpa", plan, *bf, w, scaling)  # the reference backend, run in bf16
    got = _run(backend, plan, *bf, w, scaling)
    for name, r, b0, x, factor in zip(("out", "dq", "dk", "dv"), ref, base, got, (2, 3, 3, 3)):
        e_base, e_got = _rel(b0, r), _rel(x, r)
        assert e_got <= factor * e_base, f"{backend} {name}: rel error {e_got:.2e} > {factor} x sdpa-bf16 {e_base:.2e}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sharing", ["prompt", "prefix"])
def test_model_logprobs_and_grads_bf16_vs_fp64(backend, sharing):
    """Tiny Qwen3 on CUDA: zorro bf16 (backend) vs fp64 per-row oracle, against the ordinary bf16 forward's error."""
    from zorro_verl.testing import tiny_model

    _model_bf16_vs_fp64(lambda dtype: tiny_model("qwen3", layers=2, hidden=128, heads=4, dtype=dtype), backend,
                        sharing)


def _model_bf16_vs_fp64(make, backend, sharing="prompt"):
    """``make(dtype)`` builds the same tiny model in fp64 and bf16 (moved to CUDA here); zorro's bf16 log-probs and
    gradients vs the fp64 per-row oracle, against the ordinary bf16 forward's errors (2x, 3x)."""
    from zorro_verl.integrations.transformers import install_zorro, uninstall_zorro, zorro_step
    from zorro_verl.packing import build_plan
    from zorro_verl.testing import create_dummy_batch, grads_of, ordinary_logprobs

    b = create_dummy_batch(6, 2, 40, 16, device="cuda", add_padding=True, shuffle=True, seed=1, vocab_size=100)
    if sharing == "prefix":
        b = _tree_batch()
        b["input_ids"] = b["input_ids"] % 100  # the tiny model's vocabulary
    ids, am = b["input_ids"], b["attention_mask"]
    R = b["responses"].shape[1]
    m64 = make(torch.float64).cuda()
    lp64, _ = ordinary_logprobs(m64, ids, am, R)
    lp64.sum().backward()
    g64 = grads_of(m64)

    def grads_err(g):
        return max(_rel(g[n], g64[n]) for n in g64)

    m16 = make(torch.bfloat16).cuda()
    lp_o, _ = ordinary_logprobs(m16, ids, am, R)
    lp_o.sum().backward()
    e_lp_base, e_g_base = _rel(lp_o, lp64), grads_err(grads_of(m16))
    m16.zero_grad(set_to_none=True)
    install_zorro(m16)
    try:
        lp, _ = zorro_step(m16, build_plan(ids, am, R, sharing=sharing), backend=backend)
        lp.sum().backward()
    finally:
        uninstall_zorro(m16)
    e_lp, e_g = _rel(lp, lp64), grads_err(grads_of(m16))
    assert e_lp <= 2 * e_lp_base, f"log-probs: {e_lp:.2e} > 2 x {e_lp_base:.2e}"
    assert e_g <= 3 * e_g_base, f"grads: {e_g:.2e} > 3 x {e_g_base:.2e}"


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_flash_providers_agree():
    """flash-attn's and PyTorch's built-in flash kernels give the same copy-free result (where both exist)."""
    import os

    from zorro_verl.attention import primitives
    from zorro_verl.attention.copyfree import attend_copyfree
    from zorro_verl.packing import build_plan

    try:
        import flash_attn  # noqa: F401
    except ImportError:
        pytest.skip("flash-attn not installed: only PyTorch's built-in flash kernels here")
    if not torch.backends.cuda.is_flash_attention_available():
        pytest.skip("PyTorch built without flash attention")
    b = _batch(seed=2)
    plan = build_plan(b["input_ids"], b["attention_mask"], b["responses"].shape[1])
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, h, plan.T, 64, device="cuda", dtype=torch.bfloat16, generator=g) for h in (8, 2, 2))
    outs = []
    for name in ("flash_attn", "torch"):
        os.environ["ZORRO_FLASH_PROVIDER"] = name
        try:
            outs.append(attend_copyfree(plan, q, k, v, 0.125, prims=primitives.flash_primitives()).float())
        finally:
            del os.environ["ZORRO_FLASH_PROVIDER"]
    assert _rel(outs[0], outs[1].double()) <= 1e-2


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("feat", ["window", "window_sinks", "softcap", "chunk"])
def test_features_bf16_vs_fp64_relative_rule(backend, feat):
    """Sliding window (48 tokens: inside most prompts of 80..160), sinks, soft-capping and chunked attention (chunk
    64: boundaries inside prompts and responses; the flash designs' chunk pieces include zero-length and query-less
    segments) on the GPU kernels (flash-attn's window_size / softcap, flex's block mask / score_mod), by the
    relative rule incl. the sinks' gradient."""
    from zorro_verl.attention import AttentionFeatures, attend
    from zorro_verl.attention.primitives import flash_provider
    from zorro_verl.packing import build_plan
    from zorro_verl.testing import dense_attention_oracle

    if feat == "softcap" and backend != "flex" and flash_provider() != "flash_attn":
        pytest.skip("PyTorch's built-in flash kernels have no soft-capping (refused by name; tested on CPU)")
    b = _batch(seed=3)
    plan = build_plan(b["input_ids"], b["attention_mask"], b["responses"].shape[1])
    g = torch.Generator(device="cuda").manual_seed(1)
    hq, hkv, d = 8, 2, 64
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.float64, generator=g)  # noqa: E731
    x64 = [mk(1, hq, plan.T, d), mk(1, hkv, plan.T, d), mk(1, hkv, plan.T, d)]
    if feat != "softcap":
        x64.append(mk(hq))
    w = torch.randn(1, plan.T, hq, d, device="cuda", generator=g)
    kw = {"window": 48 if feat.startswith("window") else None, "softcap": 2.0 if feat == "softcap" else None,
          "chunk": 64 if feat == "chunk" else None}

    def run(fn, xs):
        xs = [x.detach().requires_grad_(True) for x in xs]
        sinks = xs[3] if len(xs) > 3 else None
        out = fn(xs, sinks)
        return (out, *torch.autograd.grad((out.double() * w.double()).sum(), xs))

    ref = run(lambda xs, s: dense_attention_oracle(plan, *xs[:3], d ** -0.5, sinks=s, **kw), x64)
    bf = [x.to(torch.bfloat16) for x in x64]
    base = run(lambda xs, s: attend(plan, "sdpa", *xs[:3], d ** -0.5, AttentionFeatures(sinks=s, **kw)), bf)
    got = run(lambda xs, s: attend(plan, backend, *xs[:3], d ** -0.5, AttentionFeatures(sinks=s, **kw)), bf)
    for name, r, b0, x, factor in zip(("out", "dq", "dk", "dv", "dsinks"), ref, base, got, (2, 3, 3, 3, 3)):
        e_base, e_got = _rel(b0, r), _rel(x, r)
        assert e_got <= factor * e_base, f"{backend} {feat} {name}: {e_got:.2e} > {factor} x sdpa-bf16 {e_base:.2e}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["gpt_oss", "gemma2"])
def test_window_family_bf16_vs_fp64(backend, kind):
    """Tiny gpt-oss (sliding / full layers, sinks, MoE) and Gemma 2 (soft-caps) on CUDA: zorro bf16 vs the fp64
    per-row oracle, against the ordinary bf16 (eager) forward's error, window 24 inside prompts of 20..40."""
    from zorro_verl.attention.primitives import flash_provider
    from zorro_verl.testing import tiny_window_model

    if kind == "gemma2" and backend != "flex" and flash_provider() != "flash_attn":
        pytest.skip("PyTorch's built-in flash kernels have no soft-capping (refused by name; tested on CPU)")
    kw = dict(window=24, hidden=128, heads=4, vocab_size=100, layers=2)
    _model_bf16_vs_fp64(lambda dtype: tiny_window_model(kind, dtype=dtype, **kw), backend)
