"""zorro's Megatron engine as verl builds it on a GPU (docs/design/megatron.md "The Megatron engine", testing.md):
Megatron-Bridge (verl's default builder) with its default Transformer Engine layer spec, verl's
``attention_backend=flash``, TE's fused RoPE fed zorro's per-token table, verl's packed (THD) path on the stock side;
one GPU, bf16.

zorro's class swap wraps TE's core attention: calls with a zorro plan run zorro's split attention (the settings'
``auto`` backend), every other call — the stock engine's THD varlen calls, the ``warn`` fallback — runs TE's own.

By the relative rule: log-probs against HF transformers' fp32 forward of the same checkpoint (per row, SDPA),
zorro's bf16 error within 2x the stock bf16 engine's; gradients (relative Frobenius per parameter) of zorro vs the
stock engine within 3x of the stock engine's own bf16 noise (the stock engine at another micro-batch size: the same
computation reassociated). Skipped without CUDA, Transformer Engine, megatron-core, Megatron-Bridge or verl
(scripts/gpu_check.sh runs it where they are installed: verl's Megatron image).
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.gpu

pytest.importorskip("megatron.core", reason="megatron-core is not installed here")
pytest.importorskip("transformer_engine", reason="Transformer Engine is not installed here")
pytest.importorskip("megatron.bridge", reason="Megatron-Bridge is not installed here")
pytest.importorskip("verl", reason="verl is not installed here")

ZORRO = {"enable": True, "rollout_n": 4, "attention_backend": "auto"}


def _init(tmp_path) -> None:
    import torch.distributed as dist

    if not dist.is_initialized():  # a file rendezvous: no port to pick
        dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
        torch.cuda.set_device(0)


def _engine(ckpt: str, zorro: dict | None, micro_batch: int = 2, max_tokens: int = 48):
    """verl's Megatron LM engine on this GPU through Megatron-Bridge (its TE spec, bf16, fused RoPE)."""
    from tests.support.megatron_engines import build_gpu_engine

    return build_gpu_engine(ckpt, zorro=zorro, micro_batch=micro_batch, max_tokens=max_tokens,
                            transformer_overrides={"apply_rope_fusion": True})


def _hf_log_probs(ckpt: str, td) -> torch.Tensor:
    """HF transformers' fp32 forward, each row alone: response log-probs ``[N]`` fp64."""
    import transformers

    from zorro_verl.integrations.verl.v09.batching import row_lengths

    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32,
                                                              attn_implementation="sdpa").cuda()
    p, r = row_lengths(td)
    ids = td["input_ids"]
    out = []
    with torch.no_grad():
        for b in range(len(p)):
            x = ids[b].cuda()
            logp = torch.log_softmax(model(input_ids=x[None]).logits[0].double(), -1)
            out.append(logp[p[b] - 1:p[b] + r[b] - 1].gather(-1, x[p[b]:p[b] + r[b], None])[:, 0])
    return torch.cat(out)


def _rel(x, ref) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_megatron_bridge_te_engine_relative_rule(tmp_path):
    from tests.support import megatron_engines as E

    _init(tmp_path)
    os.environ.pop("NVTE_FUSED_ATTN", None)  # megatron sets these per build (AttnBackend.flash)
    ckpt = E.save_tiny_checkpoint(str(tmp_path / "ckpt"))
    engines = {"stock": _engine(ckpt, None), "stock_mb4": _engine(ckpt, None, micro_batch=4),
               "zorro": _engine(ckpt, ZORRO)}
    core = type(E.gpt_of(engines["zorro"]).decoder.layers[0].self_attention.core_attention)
    assert core.__name__.startswith("Zorro") and any("TE" in c.__name__ for c in core.__mro__), core.__mro__
    td = E.make_batch(dynamic=False)
    ref = _hf_log_probs(ckpt, td)
    lp, g = {}, {}
    for name, eng in engines.items():
        with eng.eval_mode():
            res = eng.infer_batch(E.make_batch(dynamic=False), loss_function=None)
        lp[name] = E.response_values(res["model_output"]["log_probs"], td).cuda()
        with eng.train_mode(zero_grad_on_exit=False):
            eng.train_batch(E.make_batch(dynamic=False), loss_function=E.ppo_loss_fn())
        g[name] = E.grads(eng)
    e_stock, e_zorro = _rel(lp["stock"], ref), _rel(lp["zorro"], ref)
    noise = max(_rel(g["stock_mb4"][k], g["stock"][k]) for k in g["stock"])
    e_grad = max(_rel(g["zorro"][k], g["stock"][k]) for k in g["stock"])
    print(f"Megatron-Bridge TE engine bf16: log-probs zorro {e_zorro:.2e} (stock {e_stock:.2e}) vs HF fp32; "
          f"gradients zorro vs stock {e_grad:.2e} (stock's own noise {noise:.2e})")
    assert e_zorro <= 2 * e_stock, f"log-probs: {e_zorro:.2e} > 2 x {e_stock:.2e}"
    # the noise floored at bf16's unit roundoff (2^-8): two runs whose sums happen to round alike give 0
    assert e_grad <= 3 * max(noise, 2.0 ** -8), f"gradients: {e_grad:.2e} > 3 x {noise:.2e}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_megatron_bridge_te_engine_qwen25_vl_relative_rule(tmp_path):
    """Qwen2.5-VL (Megatron-Bridge's ``Qwen25VLModel`` on its Transformer Engine spec, bf16, the CPU test's tiny
    checkpoint and batch, tests/support/megatron_vlm.py): zorro's engine — the vision tower once per unique image, the
    packed row's 3-D positions, TE's core attention wrapped — against the stock engine by the relative rule:
    log-probs against transformers' fp32 Qwen2.5-VL within 2x stock's error, gradients (the vision tower's included)
    against stock within 3x stock's own bf16 noise (stock at another micro-batch size)."""
    from tests.support import megatron_engines as E
    from tests.support import megatron_vlm as V

    _init(tmp_path)
    os.environ.pop("NVTE_FUSED_ATTN", None)
    ckpt = V.save_tiny_qwen25vl(str(tmp_path / "vlm"))
    cfg = V.tiny_qwen25vl_config()

    def batch():
        return V.make_vlm_batch(cfg, dynamic=False, micro_batch=4, max_tokens=160)

    engines = {"stock": _engine(ckpt, None, micro_batch=4, max_tokens=160),
               "stock_mb2": _engine(ckpt, None, micro_batch=2, max_tokens=160),
               "zorro": _engine(ckpt, ZORRO, micro_batch=4, max_tokens=160)}
    assert type(E.gpt_of(engines["zorro"])).__name__ == "Qwen25VLModel"
    td = batch()
    ref = V.hf_vlm_log_probs(ckpt, td).double()
    lp, g, fallback = {}, {}, None
    for name, eng in engines.items():
        with eng.eval_mode():
            res = eng.infer_batch(batch(), loss_function=None)
        lp[name] = E.response_values(res["model_output"]["log_probs"], td).cpu()
        with eng.train_mode(zero_grad_on_exit=False):
            tr = eng.train_batch(batch(), loss_function=E.ppo_loss_fn())
        g[name] = E.grads(eng)
        if name == "zorro":
            v = tr["metrics"].get("zorro/fallback_batches", 0.0)
            fallback = float(v[0] if isinstance(v, (list, tuple)) else v)
    e_stock, e_zorro = _rel(lp["stock"], ref), _rel(lp["zorro"], ref)
    noise = max(_rel(g["stock_mb2"][k], g["stock"][k]) for k in g["stock"])
    e_grad = max(_rel(g["zorro"][k], g["stock"][k]) for k in g["stock"])
    print(f"Qwen2.5-VL Megatron-Bridge TE engine bf16: log-probs zorro {e_zorro:.2e} (stock {e_stock:.2e}) vs HF "
          f"fp32; gradients zorro vs stock {e_grad:.2e} (stock's own noise {noise:.2e}); fallback {fallback}")
    assert fallback == 0.0
    assert e_zorro <= 2 * e_stock, f"log-probs: {e_zorro:.2e} > 2 x {e_stock:.2e}"
    assert e_grad <= 3 * max(noise, 2.0 ** -8), f"gradients: {e_grad:.2e} > 3 x {noise:.2e}"
