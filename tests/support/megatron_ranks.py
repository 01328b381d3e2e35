"""One rank of the 2-process Megatron check (tests/integrations/megatron/test_gpt_step.py): gloo with a ``file://``
rendezvous, megatron's TP = 2 groups, and every 2-rank case in the same two processes (importing megatron-core costs
12-40 s per process): zorro vs megatron's ordinary forward with TP = 2, and with TP = 2 + sequence parallelism (the
packed row padded to a multiple of 2), prompt and prefix-tree plans.

Run as ``python -m tests.support.megatron_ranks RANK WORLD INIT_FILE OUT_JSON``. Each case returns this rank's
maximum differences (log-probs, entropy, relative gradient of the rank's shards) and whether the two ranks returned
identical log-probs.
"""

from __future__ import annotations

import warnings

import torch

from tests.support.multi_rank import rank_main

#: (name, sequence parallel, sharing)
CASES = [("tp2", False, "prompt"), ("tp2_sp", True, "prompt"), ("tp2_sp_prefix", True, "prefix")]


def run_rank(rank: int, world: int, init_file: str) -> dict:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    import torch.distributed as dist

    from tests.support import megatron_cpu as M

    M.init_megatron(rank, world, init_file)
    out = {}
    for name, sp, sharing in CASES:
        stock = M.build_gpt(zorro=False, sequence_parallel=sp, parallel_output=False)
        zorro = M.build_gpt(zorro=True, sequence_parallel=sp)
        zorro.load_state_dict(stock.state_dict())
        ids, am, R = M.make_batch(shared_prefix=sharing == "prefix")
        s = M.stock_outputs(stock, ids, am, R, tp_multiple=world if sp else 1)
        lp, ent, plan = M.zorro_outputs(zorro, ids, am, R, sharing=sharing)
        res = M.compare(s, (lp, ent), M.grads(stock), M.grads(zorro))
        both = [torch.empty_like(lp) for _ in range(world)]
        dist.all_gather(both, lp)
        res["ranks_equal"] = bool(all(torch.equal(both[0], x) for x in both))
        res["T"] = plan.T
        res["sp"] = bool(zorro.config.sequence_parallel)
        out[name] = res
    dist.barrier()
    return out


if __name__ == "__main__":
    rank_main(run_rank)
