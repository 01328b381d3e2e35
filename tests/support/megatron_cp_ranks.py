"""One rank of the Megatron context-parallel check (tests/integrations/megatron/test_context_parallel.py): gloo with
a ``file://`` rendezvous, the tiny fp64 ``GPTModel`` of :mod:`tests.support.megatron_cpu`.

First the model-parallel groups without CP (``CP = 1``, TP = ``tp``; the other ranks data parallel): megatron's
ordinary forward (its own ``DotProductAttention`` on the padded rows, no project code) and zorro's step, on the same
batch and test loss; then the groups rebuilt with ``CP = 2`` in the same processes: zorro's step on each rank's
zigzag share of the packed row, log-probs / entropy gathered back to ``[N]`` in original order, every parameter's
gradient summed over the CP group (megatron's data-parallel reduction includes the CP ranks). Prompt and prefix-tree
plans; ``tp = 2`` adds sequence parallelism (each CP rank's slice a multiple of 2). Also the all-gather bytes of
one forward against :func:`~zorro_verl.packing.context_parallel.cp_kv_bytes` per layer, and the non-zorro call
refused on megatron's local attention under CP.

Run as ``python -m tests.support.megatron_cp_ranks RANK WORLD INIT_FILE TP OUT_JSON``.
"""

from __future__ import annotations

import warnings

import torch

from tests.support.multi_rank import rank_main


def _cp_grads(model) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from tests.support import megatron_cpu as M

    g = M.grads(model)  # SP norms summed over TP
    for t in g.values():
        dist.all_reduce(t, group=parallel_state.get_context_parallel_group())
    return g


def _counting_gather(real_gather, moved: list, group):
    """``dist.all_gather`` recording the bytes this rank receives on ``group``."""

    def gather(parts, x, group_=None, **kw):
        if group_ is group:
            moved.append(x.numel() * x.element_size() * (len(parts) - 1))
        return real_gather(parts, x, group=group_, **kw)

    return lambda parts, x, group=None, **kw: gather(parts, x, group, **kw)


def run_rank(rank: int, world: int, init_file: str, tp: int) -> dict:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    import torch.distributed as dist

    from tests.support import megatron_cpu as M

    sp = tp > 1
    M.init_megatron(rank, world, init_file, tensor=tp, context=1)
    ref = {}
    for sharing in ("prompt", "prefix"):
        stock = M.build_gpt(zorro=False, sequence_parallel=sp, parallel_output=False)
        z1 = M.build_gpt(zorro=True, sequence_parallel=sp)
        z1.load_state_dict(stock.state_dict())
        ids, am, R = M.make_batch(shared_prefix=sharing == "prefix")
        s = M.stock_outputs(stock, ids, am, R, tp_multiple=tp)
        lp1, ent1, _ = M.zorro_outputs(z1, ids, am, R, sharing=sharing)
        ref[sharing] = (stock.state_dict(), s, M.grads(stock), (lp1, ent1), M.grads(z1))

    M.init_megatron(rank, world, init_file, tensor=tp, context=2)
    from megatron.core import parallel_state

    from zorro_verl.packing.context_parallel import cp_kv_bytes

    assert parallel_state.get_context_parallel_world_size() == 2
    out = {}
    for sharing in ("prompt", "prefix"):
        state, s, g_stock, z1, g_z1 = ref[sharing]
        zcp = M.build_gpt(zorro=True, sequence_parallel=sp)
        assert zcp.config.context_parallel_size == 2
        zcp.load_state_dict(state)
        ids, am, R = M.make_batch(shared_prefix=sharing == "prefix")
        moved, real_gather = [], dist.all_gather
        dist.all_gather = _counting_gather(real_gather, moved, parallel_state.get_context_parallel_group())
        try:
            lp, ent, plan = M.zorro_outputs(zcp, ids, am, R, sharing=sharing)
        finally:
            dist.all_gather = real_gather
        g_cp = _cp_grads(zcp)
        res = M.compare(s, (lp, ent), g_stock, g_cp)
        vs1 = M.compare(z1, (lp, ent), g_z1, g_cp)
        res.update({"vs_zorro_cp1_" + k: v for k, v in vs1.items() if k in ("logprob", "entropy", "grad_rel")})
        both = [torch.empty_like(lp) for _ in range(world)]
        dist.all_gather(both, lp)
        res["ranks_equal"] = bool(all(torch.equal(both[0], x) for x in both))
        shard = plan.memo.get(("megatron_cp", 2, parallel_state.get_context_parallel_rank(), tp if sp else 1),
                              lambda: None)
        cfg = zcp.config
        per_layer = cp_kv_bytes(shard.local_len, 2, cfg.num_query_groups // tp, cfg.kv_channels, 8)
        # the layers' K/V gathers, then the log-prob and entropy gathers of the head rows
        res["kv_bytes"] = sum(moved[:cfg.num_layers])
        res["kv_bytes_formula"] = cfg.num_layers * per_layer
        res["T"], res["L"], res["sp"] = plan.T, shard.local_len, bool(cfg.sequence_parallel)
        out[sharing] = res
    # an ordinary call on megatron's local attention under CP is refused (it has no CP exchange)
    layer = zcp.decoder.layers[0].self_attention.core_attention
    x = torch.zeros(4, 1, 2, 16, dtype=torch.float64)
    try:
        layer(x, x, x, None)
        out["refused"] = ""
    except ValueError as e:
        out["refused"] = str(e)
    dist.barrier()
    return out


if __name__ == "__main__":
    rank_main(run_rank, int)
