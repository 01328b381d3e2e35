"""The attention-memory harness (zorro_verl.bench.memory): its byte counts vs counts computed by hand from the
shapes of what each design keeps, the budget filling vs the arithmetic of whole groups, the stand-in kernels' state
vs the flash-attn adapter's, and the command line."""

import json

import pytest
import torch

from tests.attention.test_copyfree import fake_flash_attn
from zorro_verl.bench.memory import (
    MemScenario,
    _stock_fn,
    _zorro_fn,
    check_memory_rule,
    gpu_standin_primitives,
    parse_memory_scenario,
    saved_bytes,
    zorro_inputs,
    zorro_microbatch,
)

BF16, F32, I32, I64 = 2, 4, 4, 8  # bytes
SC = MemScenario("tiny", G=2, n=3, P=8, R=4, Hq=4, Hkv=2, D=8)  # budget 2*3*12 = 72 tokens
CPU = torch.device("cpu")
PRIMS = gpu_standin_primitives()


def _qkv_out_bytes(T: int, sc: MemScenario) -> int:
    """q, k, v and out of ``T`` tokens, bf16."""
    return T * (2 * sc.Hq + 2 * sc.Hkv) * sc.D * BF16


def test_stock_count_is_q_k_v_out_and_lse():
    fn, _, rows, T = _stock_fn(SC, torch.bfloat16, CPU, PRIMS)
    _, got = saved_bytes(fn)
    assert (rows, T) == (6, 72)
    assert got["float"] == _qkv_out_bytes(T, SC) + SC.Hq * T * F32  # + lse [Hq, T] fp32
    assert got["index"] == (rows + 1) * I32 + 2 * I64  # cu_seqlens (one tensor for q and k), RNG state [2]


def test_zorro_microbatch_fills_whole_groups_to_the_budget():
    # a group costs P + n R = 8 + 12 = 20 tokens: 72 // 20 = 3 whole groups, 9 rows
    assert zorro_microbatch(SC) == (9, 3)
    # the shape: budget 16 * 576 = 9216, a group 512 + 8 * 64 = 1024 -> 9 groups, 72 rows
    assert zorro_microbatch(MemScenario("x", G=2, n=8, P=512, R=64, Hq=1, Hkv=1, D=1)) == (72, 9)
    # longer responses: budget 16 * 1024 = 16384, a group 512 + 8 * 512 = 4608 -> 3 groups
    assert zorro_microbatch(MemScenario("y", G=2, n=8, P=512, R=512, Hq=1, Hkv=1, D=1)) == (24, 3)


def test_copyfree_keeps_what_stock_keeps_per_token():
    """flash_copyfree: the packed q/k/v (the inputs' own storages), out, and the prompt and response lse."""
    fn, _, rows, T = _zorro_fn(SC, "flash_copyfree", torch.bfloat16, CPU, PRIMS)
    _, got = saved_bytes(fn)
    assert (rows, T) == (9, 3 * 8 + 9 * 4)
    Np, N = 3 * SC.P, 9 * SC.R
    assert got["float"] == _qkv_out_bytes(T, SC) + SC.Hq * (Np + N) * F32


def test_flash_keeps_the_gathered_prompt_copies():
    """flash: per call its gathered q/k/v, out and lse; the response call's k/v hold every row's prompt again."""
    fn, _, rows, T = _zorro_fn(SC, "flash", torch.bfloat16, CPU, PRIMS)
    _, got = saved_bytes(fn)
    Np, N = 3 * SC.P, 9 * SC.R
    K = rows * (SC.P + SC.R)  # [its prompt ; itself] per response
    prompt_call = Np * (2 * SC.Hq + 2 * SC.Hkv) * SC.D * BF16 + SC.Hq * Np * F32
    response_call = N * 2 * SC.Hq * SC.D * BF16 + K * 2 * SC.Hkv * SC.D * BF16 + SC.Hq * N * F32
    assert got["float"] == prompt_call + response_call


def test_ctx_tensors_and_shared_storages():
    """A tensor a Function keeps on ``ctx`` is counted; views of one storage count once, at its full size."""

    class Keep(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.extra = {"kept": [x.detach() * 2]}  # [10] fp32 beside the saved input
            ctx.save_for_backward(x, x[:3])
            return x * 3

        @staticmethod
        def backward(ctx, g):
            return g * 3

    x = torch.randn(10, requires_grad=True)
    _, got = saved_bytes(lambda: Keep.apply(x) * 1.0)
    assert got == {"float": 2 * 10 * F32, "index": 0, "storages": 2}


def test_standin_state_matches_the_flash_attn_adapter(monkeypatch):
    """What the copy-free attention keeps through flash-attn's adapter (stand-ins of flash-attn 2.7's calls) is
    what the harness's stand-in kernels make it keep: the kernels' lse is not held beside the merged one."""
    from zorro_verl.attention import primitives
    from zorro_verl.attention.copyfree import attend_copyfree

    fake_flash_attn(monkeypatch)
    adapter = primitives._flash_attn_primitives()
    plan, q, k, v, _ = zorro_inputs(SC, torch.float32, CPU)
    _, via_standin = saved_bytes(lambda: attend_copyfree(plan, q, k, v, SC.D ** -0.5, prims=PRIMS))
    _, via_adapter = saved_bytes(lambda: attend_copyfree(plan, q, k, v, SC.D ** -0.5, prims=adapter))
    assert via_adapter["float"] == via_standin["float"]


def test_lse_layout_round_trip_of_a_padded_kernel_lse():
    """Older kernels' lse ``[n, Hq, max_q]``: the state keeps only its shape, and the backward's lse in that layout
    holds the flat values at every query row."""
    from zorro_verl.attention.primitives import _lse_from_flat, _lse_to_flat, lse_layout

    cu = torch.tensor([0, 3, 4, 8], dtype=torch.int32)
    padded = torch.randn(3, 2, 5)
    flat = _lse_to_flat(padded, cu, 8)  # [2, 8]
    layout = lse_layout(padded, 8)
    assert layout == (3, 2, 5) and lse_layout(flat, 8) is None
    back = _lse_from_flat(flat, layout, cu)
    for s, (a, b) in enumerate(((0, 3), (3, 4), (4, 8))):
        assert torch.equal(back[s, :, :b - a], padded[s, :, :b - a])
    assert torch.equal(_lse_from_flat(flat, None, cu), flat)  # flat kernels: the flat lse itself


def test_parse_and_rule_lines():
    assert parse_memory_scenario("gqa").Hkv == 4
    sc = parse_memory_scenario("2,3,8,4,4,2,8")
    assert (sc.G, sc.n, sc.P, sc.R, sc.Hq, sc.Hkv, sc.D) == (2, 3, 8, 4, 4, 2, 8)
    for bad in ("2,3,8,4,4,3,8", "2,3,8", "gqa2"):
        with pytest.raises(ValueError, match="--memory-scenario"):
            parse_memory_scenario(bad)
    rows = [{"backend": "flash_copyfree", "measured": True, "ratio": r, "scenario": s} for s, r in
            (("a", 1.0), ("b", 1.01))]
    assert [line.split(":")[0] for line in check_memory_rule(rows)] == ["ok", "FAIL"]


def test_cli_memory_run(tmp_path, capsys):
    from zorro_verl.bench.cli import main

    path = tmp_path / "mem.json"
    rc = main(["--memory", "--memory-scenario", "2,3,8,4,4,2,8", "--backends", "flash,flash_copyfree,flex",
               "--json", str(path)])
    out = capsys.readouterr().out
    rows = json.loads(path.read_text())
    assert rc == 0 and "ok: " in out
    assert [r["backend"] for r in rows] == ["stock", "flash", "flash_copyfree", "flex"]
    # copy-free keeps stock's bytes per token: its ratio is the token ratio (3 groups of 20 in a budget of 72)
    assert rows[2]["T"] == 60 and rows[2]["ratio"] == pytest.approx(60 / 72, rel=1e-12)
    assert rows[1]["ratio"] > 1.0 and rows[3]["measured"] is False
    with pytest.raises(ValueError, match="--memory"):
        main(["--memory", "--ops"])


def test_auto_on_cuda_meets_the_memory_rule(monkeypatch):
    """What ``attention_backend: auto`` resolves to on CUDA with flash kernels, measured by the harness: at most
    stock's saved bytes at the same budget, on the issue's shape (heads scaled down: the ratio depends on Hq / Hkv
    and D only) — and ``flash`` over it."""
    from zorro_verl.bench.memory import run_memory
    from zorro_verl.integrations.verl.settings import resolve_attention_backend

    monkeypatch.setenv("ZORRO_FLASH_PROVIDER", "torch")
    auto = resolve_attention_backend("auto", "cuda")
    sc = MemScenario("issue", G=2, n=8, P=512, R=64, Hq=4, Hkv=1, D=16)
    rows = run_memory([sc], backends=[auto, "flash"], log=lambda *a: None)
    lines = check_memory_rule(rows, backend=auto)
    assert len(lines) == 1 and lines[0].startswith("ok"), lines
    by = {r["backend"]: r for r in rows}
    assert by[auto]["ratio"] <= 1.0 < by["flash"]["ratio"]
