"""One rank of the GPU context-parallel *engine* check (tests/integrations/megatron/test_gpu_context_parallel.py):
NCCL, one GPU per rank, verl 0.9.1's Megatron engine built by Megatron-Bridge with its Transformer Engine layer spec,
bf16, CP = 2 over the two ranks. **Stock CP** is verl's own engine (its THD zigzag split, TE's CP attention, the
logits gathered back); **zorro CP** is zorro's engine (each rank its share of the packed row). Megatron's ordinary
loss regime (what verl's Megatron-Bridge path builds for a dense model). Returns, by the relative rule: each engine's
log-probs against HF transformers' fp32 forward of the same checkpoint (per row), and zorro's gradients against the
stock CP engine's with the stock engine's own bf16 noise (stock CP at another micro-batch size: the same computation
reassociated).

Run as ``python -m tests.support.megatron_gpu_engine_cp_ranks RANK WORLD INIT_FILE CKPT_DIR OUT_JSON``.
"""

from __future__ import annotations

import torch

from tests.support.multi_rank import rank_main

ZORRO = {"enable": True, "rollout_n": 4, "attention_backend": "auto"}


def _engine(ckpt: str, zorro: dict | None, micro_batch: int = 2):
    """verl's Megatron LM engine on this rank's GPU through Megatron-Bridge (TE spec, bf16), CP = 2."""
    from tests.support.megatron_engines import build_gpu_engine

    return build_gpu_engine(ckpt, zorro=zorro, cp=2, micro_batch=micro_batch)


def _hf_log_probs(ckpt: str, td) -> torch.Tensor:
    """HF transformers' fp32 forward, each row alone: response log-probs ``[N]`` fp64."""
    import transformers

    from zorro_verl.integrations.verl.v09.batching import row_lengths

    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32,
                                                              attn_implementation="sdpa").cuda()
    p, r = row_lengths(td)
    out = []
    with torch.no_grad():
        for b in range(len(p)):
            x = td["input_ids"][b].cuda()
            logp = torch.log_softmax(model(input_ids=x[None]).logits[0].double(), -1)
            out.append(logp[p[b] - 1:p[b] + r[b] - 1].gather(-1, x[p[b]:p[b] + r[b], None])[:, 0])
    return torch.cat(out)


def _rel(x, ref) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def run_rank(rank: int, world: int, init_file: str, ckpt: str) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from tests.support import megatron_engines as E

    assert world == 2, world
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    if rank == 0:
        E.save_tiny_checkpoint(ckpt)
    dist.barrier()
    engines = {"stock": _engine(ckpt, None), "stock_mb4": _engine(ckpt, None, micro_batch=4),
               "zorro": _engine(ckpt, ZORRO)}
    assert mpu.get_context_parallel_world_size() == 2
    td = E.make_batch(dynamic=False)
    ref = _hf_log_probs(ckpt, td)
    lp, g, fallback = {}, {}, None
    for name, eng in engines.items():
        with eng.eval_mode():
            res = eng.infer_batch(E.make_batch(dynamic=False), loss_function=None)
        lp[name] = E.response_values(res["model_output"]["log_probs"], td).cuda()
        with eng.train_mode(zero_grad_on_exit=False):
            tr = eng.train_batch(E.make_batch(dynamic=False), loss_function=E.ppo_loss_fn())
        g[name] = E.grads(eng)
        if name == "zorro":
            v = tr["metrics"].get("zorro/fallback_batches", 0.0)
            fallback = float(v[0] if isinstance(v, (list, tuple)) else v)
    return {"lp": _rel(lp["zorro"], ref), "lp_stock": _rel(lp["stock"], ref),
            "grad": max(_rel(g["zorro"][k], g["stock"][k]) for k in g["stock"]),
            "grad_noise": max(_rel(g["stock_mb4"][k], g["stock"][k]) for k in g["stock"]),
            "per_token_loss": bool(E.gpt_of(engines["zorro"]).config.calculate_per_token_loss),
            "fallback": fallback}


if __name__ == "__main__":
    rank_main(run_rank, str)
