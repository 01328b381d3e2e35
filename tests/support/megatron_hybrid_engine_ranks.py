"""The Qwen3.5 (gated delta-net hybrid) engine check (tests/integrations/megatron/test_engine_hybrid.py): verl 0.9.1's
stock Megatron engine (padded bshd path: megatron's own ``GatedDeltaNet`` and ``DotProductAttention``) vs zorro's,
fp32 on the CPU, on a tiny ``Qwen3_5ForCausalLM`` checkpoint built by Megatron-Bridge's ``Qwen35Bridge`` (verl's
default builder) on the CPU stand-ins of tests/support/megatron_gdn.py. One process (TP = 1). Returns
``{"model": ..., "hf": ..., "step1": ..., "step2": ..., "prefix": ...}``.

Run as ``python -m tests.support.megatron_hybrid_engine_ranks RANK WORLD INIT_FILE CKPT_DIR OUT_JSON``.
"""

from __future__ import annotations

from functools import partial

import torch

from tests.support.multi_rank import rank_main


def _hf_log_probs(ckpt: str, td) -> torch.Tensor:
    """transformers' own Qwen3.5 forward (fp32, its torch gated delta rule) on each row alone: the response tokens'
    log-probs ``[N]`` in row order — the reference the stand-ins replace TE / FLA against."""
    import transformers

    from zorro_verl.integrations.verl.v09.batching import row_lengths

    model = transformers.Qwen3_5ForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32).eval()
    p, r = row_lengths(td)
    ids = td["input_ids"]
    out = []
    with torch.no_grad():
        for b in range(len(p)):
            row = ids[b]
            if r[b] == 0:
                continue
            logp = torch.log_softmax(model(input_ids=row[None]).logits[0].float(), -1)
            out.append(logp[p[b] - 1:p[b] + r[b] - 1].gather(-1, row[p[b]:p[b] + r[b], None])[:, 0])
    return torch.cat(out)


def _step2(E, stock, zorro) -> dict:
    """A second ``train_batch`` on both engines (after step 1's SGD update): every gradient, the parameters after."""
    for eng in (stock, zorro):
        with eng.train_mode(zero_grad_on_exit=False):
            eng.train_batch(E.make_batch(dynamic=False, seed=1), loss_function=E.ppo_loss_fn())
    gs, gz = E.grads(stock), E.grads(zorro)
    ps, pz = dict(E.gpt_of(stock).named_parameters()), dict(E.gpt_of(zorro).named_parameters())
    return {"grad_rel": max(((gz[k] - gs[k]).abs().max() / gs[k].abs().max().clamp_min(1e-30)).item() for k in gs),
            "param_after_step": max((pz[k] - ps[k]).abs().max().item() for k in ps), "n_params": len(gs)}


def run_rank(rank: int, world: int, init_file: str, ckpt: str) -> dict:
    import torch.distributed as dist
    from megatron.core.ssm.gated_delta_net.gdn import GatedDeltaNet
    from megatron.core.transformer.attention import SelfAttention

    from tests.support import megatron_engines as E
    from tests.support import megatron_gdn
    from tests.support.megatron_engine_ranks import ZORRO, _compare_engines
    from zorro_verl.integrations.megatron.gdn import ZorroGatedDeltaNet

    E.setup_process()
    E.start_rank(rank, world, init_file, ckpt, save=partial(megatron_gdn.save_tiny_qwen35, vocab=E.VOCAB))
    stock = E.build_engine(ckpt, zorro=None, remove_padding=False)
    zorro = E.build_engine(ckpt, zorro=ZORRO)
    gpt = E.gpt_of(zorro)
    mixers = [type(layer.self_attention) for layer in gpt.decoder.layers]
    out = {"model": {"gdn": sum(issubclass(m, GatedDeltaNet) for m in mixers),
                     "zorro_gdn": sum(issubclass(m, ZorroGatedDeltaNet) for m in mixers),
                     "attention": sum(issubclass(m, SelfAttention) for m in mixers),
                     "provider_spec": E.gpt_of(stock).config.experimental_attention_variant,
                     "engine": type(zorro).__name__}}
    # the stand-ins (CPU block spec, FLA kernels) through the bridge vs transformers' Qwen3.5 on the same checkpoint
    with stock.eval_mode():
        res = stock.infer_batch(E.make_batch(dynamic=False), loss_function=None)
    td = E.make_batch(dynamic=False)
    lp = E.response_values(res["model_output"]["log_probs"], td)
    out["hf"] = {"log_probs": (lp - _hf_log_probs(ckpt, td)).abs().max().item(), "n": int(lp.numel())}
    out["step1"] = _compare_engines(E, stock, zorro, partial(E.make_batch, dynamic=False), rank)
    out["step2"] = _step2(E, stock, zorro)
    # prompts with a common start (a prefix tree: the state carried down the trie), dynamic budget, fresh engines
    stock = E.build_engine(ckpt, zorro=None, remove_padding=False)
    zorro = E.build_engine(ckpt, zorro={**ZORRO, "sharing": "prefix", "min_shared_len": 1})
    out["prefix"] = _compare_engines(E, stock, zorro, partial(E.make_batch, dynamic=True, shared_prefix=True), rank)
    dist.barrier()
    return out


if __name__ == "__main__":
    rank_main(run_rank, str)
