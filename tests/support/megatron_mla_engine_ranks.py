"""One rank of the DeepSeek-V3 (multi-latent attention + MoE) engine check (tests/integrations/megatron/
test_engine_mla.py): verl 0.9.1's stock Megatron engine (padded bshd path, megatron's own attention) vs zorro's, fp32
on the CPU, on a tiny DeepSeek-V3 checkpoint built by each installed model builder in turn (Megatron-Bridge's
``DeepSeekV3Bridge``, verl's default, then vanilla mbridge's ``DeepseekV3Bridge``: tests/support/megatron_deepseek.py),
TP = ``world`` (+ sequence parallelism when > 1), fixed and dynamic micro-batches, then ``sharing=prefix``. Returns
``{bridge: {case: the maxima of megatron_engine_ranks._compare_engines}}``.

Run as ``python -m tests.support.megatron_mla_engine_ranks RANK WORLD INIT_FILE CKPT_DIR OUT_JSON``.
"""

from __future__ import annotations

import os
from functools import partial

import torch

from tests.support.multi_rank import rank_main


def _cases(E, D, ckpt: str, rank: int, world: int, bridge: str) -> dict:
    """The model's shape and the three comparisons on the engines ``bridge`` builds (Megatron-Bridge: its
    ``DeepSeekV3Bridge`` with B1's local decoder block; mbridge: its ``DeepseekV3Bridge``, D1-D5)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from safetensors.torch import load_file

    from tests.support.megatron_engine_ranks import MOE_CPU, ZORRO, _compare_engines
    from zorro_verl.integrations.megatron import ZorroMLA

    kw = dict(tp=world, transformer_overrides={**D.OVERRIDE, **MOE_CPU}, bridge=bridge)
    stock = E.build_engine(ckpt, zorro=None, remove_padding=False, **kw)
    zorro = E.build_engine(ckpt, zorro=ZORRO, **kw)
    gpt = E.gpt_of(zorro)
    # the MoE layer's router as loaded (the router is replicated over TP): the checkpoint's gate
    gate = load_file(os.path.join(ckpt, "model.safetensors"))["model.layers.1.mlp.gate.weight"]
    out = {"model": {"mla_layers": sum(isinstance(m, ZorroMLA) for m in gpt.modules()),
                     "moe_layers": sum(isinstance(m, MoELayer) for m in gpt.modules()),
                     "rope_type": gpt.config.rope_type, "tp": gpt.config.tensor_model_parallel_size,
                     "sp": bool(gpt.config.sequence_parallel), "zorro": type(zorro).__name__,
                     "vanilla": bool(zorro.vanilla_bridge),
                     "router_from_checkpoint": torch.equal(gpt.decoder.layers[1].mlp.router.weight.detach(), gate)}}
    for mode in ("fixed", "dynamic"):
        out[mode] = _compare_engines(E, stock, zorro, partial(E.make_batch, dynamic=mode == "dynamic"), rank)
    # fresh engines (the ones above took an optimizer step)
    stock = E.build_engine(ckpt, zorro=None, remove_padding=False, **kw)
    zorro = E.build_engine(ckpt, zorro={**ZORRO, "sharing": "prefix", "min_shared_len": 1}, **kw)
    out["prefix"] = _compare_engines(E, stock, zorro, partial(E.make_batch, dynamic=True, shared_prefix=True), rank)
    return out


def run_rank(rank: int, world: int, init_file: str, ckpt: str) -> dict:
    import torch.distributed as dist

    from tests.support import megatron_bridge_cpu
    from tests.support import megatron_deepseek as D
    from tests.support import megatron_engines as E

    E.setup_process()
    D.patch_deepseek_bridge()
    E.start_rank(rank, world, init_file, ckpt, save=partial(D.save_tiny_deepseek_v3, vocab=E.VOCAB))
    bridges = megatron_bridge_cpu.installed_bridges()
    out = {bridge: _cases(E, D, ckpt, rank, world, bridge) for bridge in bridges}
    dist.barrier()
    return out


if __name__ == "__main__":
    rank_main(run_rank, str)
