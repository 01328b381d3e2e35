"""One rank of the 2-process MoE check (tests/integrations/megatron/test_moe.py): gloo with a ``file://`` rendezvous,
then in the same two processes (megatron-core's import costs 12-40 s each):

* TP = 2 + sequence parallelism (the allgather dispatcher), prompt and prefix-tree plans: each rank's router sees its
  half of the packed row (zorro's: padded to a multiple of 2), the same batch on both ranks;
* EP = 2 (TP = 1, the model-parallel groups rebuilt): two local experts per rank, megatron's all-to-all dispatcher
  over gloo (CPU shims M1 + streams, :func:`tests.support.megatron_moe.alltoall_cpu_shims`), a different batch per
  rank, so the expert gradients and the global-batch statistics (all-reduced over the data-parallel ranks) combine
  both ranks' tokens.

With 4 processes instead: TP = 2 + SP x EP = 2 (2 data-parallel ranks, the all-to-all dispatcher).

Each case returns this rank's :func:`~tests.support.megatron_moe.compare_moe` of zorro vs megatron's ordinary
forward. Run as ``python -m tests.support.megatron_moe_ranks RANK WORLD INIT_FILE OUT_JSON``.
"""

from __future__ import annotations

import warnings

import torch

from tests.support.multi_rank import rank_main


def _case(build_kw: dict, batch, sharing: str, tp_multiple: int, ctx) -> dict:
    from tests.support import megatron_cpu as M
    from tests.support import megatron_moe as MM

    kw = {"moe": True, "config_hook": MM.expert_bias_on, **build_kw}
    stock = M.build_gpt(zorro=False, parallel_output=False, **kw)
    zorro = M.build_gpt(zorro=True, **kw)
    zorro.load_state_dict(stock.state_dict())
    with ctx():
        s = MM.run_moe(stock, batch, zorro=False, tp_multiple=tp_multiple)
        z = MM.run_moe(zorro, batch, zorro=True, sharing=sharing)
    res = MM.compare_moe(s, z)
    res["deduplicated"] = z["plan"].T < z["plan"].ordinary_tokens
    res["T"] = z["plan"].T
    res["sp"] = bool(zorro.config.sequence_parallel)
    mlp = zorro.decoder.layers[0].mlp
    res["local_experts"] = mlp.num_local_experts
    res["dispatcher"] = type(mlp.token_dispatcher).__name__
    return res


def run_rank(rank: int, world: int, init_file: str) -> dict:
    import contextlib

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    import torch.distributed as dist

    from tests.support import megatron_cpu as M
    from tests.support import megatron_moe as MM

    if world == 4:
        return {"ep2_tp2_sp": _ep2_tp2(rank, world, init_file)}
    M.init_megatron(rank, world, init_file)
    M.fp64_moe_routing()
    out = {}
    for sharing in ("prompt", "prefix"):
        name = "tp2_sp" if sharing == "prompt" else "tp2_sp_prefix"
        out[name] = _case({"sequence_parallel": True, "moe_overrides": MM.STATS},
                          MM.make_uniform_batch(shared_prefix=sharing == "prefix"), sharing, world,
                          contextlib.nullcontext)
    M.init_megatron(rank, world, init_file, tensor=1, expert=world)  # the same processes, now EP = 2
    MM.alltoall_cpu_shims()
    overrides = {**MM.STATS, "expert_model_parallel_size": world, "moe_token_dispatcher_type": "alltoall"}
    out["ep2"] = _case({"moe_overrides": overrides}, MM.make_uniform_batch(seed=3 + rank), "prompt", 1,
                       M.cuda_as_cpu)
    dist.barrier()
    return out


def _ep2_tp2(rank: int, world: int, init_file: str) -> dict:
    """4 processes: TP = 2 + SP inside each of 2 data-parallel ranks, EP = 2 (the expert tensor parallelism =
    TP), the all-to-all dispatcher; a batch per data-parallel rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from tests.support import megatron_cpu as M
    from tests.support import megatron_moe as MM

    M.init_megatron(rank, world, init_file, tensor=2, expert=2)
    M.fp64_moe_routing()
    MM.alltoall_cpu_shims()
    dp = parallel_state.get_data_parallel_rank()
    overrides = {**MM.STATS, "expert_model_parallel_size": 2, "moe_token_dispatcher_type": "alltoall"}
    res = _case({"sequence_parallel": True, "moe_overrides": overrides}, MM.make_uniform_batch(seed=3 + dp),
                "prompt", 2, M.cuda_as_cpu)
    dist.barrier()
    return res


if __name__ == "__main__":
    rank_main(run_rank)
