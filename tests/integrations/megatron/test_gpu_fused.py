"""zorro's Megatron engine with ``use_fused_kernels=True`` vs verl's stock fused Megatron engine on a GPU
(docs/design/megatron.md "The Megatron engine", testing.md).

verl 0.9.1's fused head on megatron-core >= 0.18 is an ``output_processor`` running its Triton
``linear_cross_entropy`` (CUDA only) at every row of verl's THD-packed batch, which needs Transformer Engine's
attention. zorro's engine accepts the setting and runs its own head at the response-predicting rows instead; on the CPU
(tests/integrations/megatron/test_engine_vpp.py) it is compared to the stock non-fused engine, here to the stock fused
one by the relative rule: the reference is an fp32 stock engine on verl's padded path with megatron's own attention
(the local spec: no fused kernel, no TE attention in fp32); stock fused in bf16 (TE spec, THD) gives the baseline
error; zorro fused in bf16 (TE spec, the settings' flash backend) must stay within 2x of it for log-probs and 3x for
gradients (relative Frobenius norms; the parameters both specs name alike). One process (world 1, NCCL). Skipped
without CUDA, megatron-core, Transformer Engine or mbridge.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

pytestmark = pytest.mark.gpu

pytest.importorskip("megatron.core", reason="megatron-core is not installed here")
pytest.importorskip("transformer_engine", reason="Transformer Engine is not installed here")
pytest.importorskip("mbridge", reason="mbridge is not installed here")

ZORRO = {"enable": True, "rollout_n": 4}


@contextlib.contextmanager
def _te_spec():
    """mbridge's own Transformer Engine spec for the builds inside (the test patches install the local spec)."""
    from mbridge.core import llm_bridge
    from megatron.core.models.gpt import gpt_layer_specs

    local = llm_bridge.get_gpt_decoder_block_spec
    llm_bridge.get_gpt_decoder_block_spec = gpt_layer_specs.get_gpt_decoder_block_spec
    try:
        yield
    finally:
        llm_bridge.get_gpt_decoder_block_spec = local


def _run(E, engine, fused: bool):
    """(response log-probs [N] fp64, gradients by name fp64) of one infer + one train batch."""
    from verl.utils import tensordict_utils as tu

    def batch():
        td = E.make_batch(dynamic=True)
        tu.assign_non_tensor(td, use_fused_kernels=fused)  # verl's forward step checks it against the engine's
        return td

    with engine.eval_mode():
        res = engine.infer_batch(batch(), loss_function=None)
    lp = E.response_values(res["model_output"]["log_probs"], batch()).double()
    with engine.train_mode(zero_grad_on_exit=False):
        engine.train_batch(batch(), loss_function=E.ppo_loss_fn())
    return lp, {k: v.double() for k, v in E.grads(engine).items()}


def _rel(x, ref):
    return ((x - ref).norm() / ref.norm()).item()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_zorro_fused_vs_stock_fused_relative_rule(tmp_path):
    import torch.distributed as dist

    from tests.support import megatron_engines as E

    if not dist.is_initialized():
        dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'rdv'}", rank=0, world_size=1)
    torch.cuda.set_device(0)
    E._mbridge_patches()  # mbridge 0.15.1 on megatron-core 0.19; the local spec for the fp32 reference
    ckpt = E.save_tiny_checkpoint(str(tmp_path / "ckpt"))
    ref = E.build_engine(ckpt, zorro=None, remove_padding=False, dtype="float32")
    lp_ref, g_ref = _run(E, ref, fused=False)
    with _te_spec():
        stock = E.build_engine(ckpt, zorro=None, dtype="bfloat16", engine_kwargs={"use_fused_kernels": True})
        zorro = E.build_engine(ckpt, zorro=ZORRO, dtype="bfloat16", engine_kwargs={"use_fused_kernels": True})
    assert stock.engine_config.use_fused_kernels and zorro.engine_config.use_fused_kernels
    assert type(zorro).__name__ == "ZorroMegatronEngineWithLMHead" and zorro._zorro_static_reason is None
    lp_s, g_s = _run(E, stock, fused=True)
    lp_z, g_z = _run(E, zorro, fused=True)
    # the local and TE specs name the norms differently (TE fuses them into the next linear): the shared names are
    # every linear layer, the embedding, the head and the q/k and final norms
    shared = sorted(g_ref.keys() & g_s.keys() & g_z.keys())
    assert "output_layer.weight" in shared and any("linear_qkv.weight" in n for n in shared), shared
    e_lp, e_lp_base = _rel(lp_z, lp_ref), _rel(lp_s, lp_ref)
    e_g = max(_rel(g_z[n], g_ref[n]) for n in shared)
    e_g_base = max(_rel(g_s[n], g_ref[n]) for n in shared)
    print(f"megatron engine bf16, use_fused_kernels: zorro log-probs {e_lp:.2e} (stock fused {e_lp_base:.2e}), "
          f"grads {e_g:.2e} (stock fused {e_g_base:.2e}); zorro vs stock fused log-probs {_rel(lp_z, lp_s):.2e}")
    assert 0 < e_lp_base and e_lp <= 2 * e_lp_base, f"log-probs: {e_lp:.2e} > 2 x {e_lp_base:.2e}"
    assert 0 < e_g_base and e_g <= 3 * e_g_base, f"grads: {e_g:.2e} > 3 x {e_g_base:.2e}"
