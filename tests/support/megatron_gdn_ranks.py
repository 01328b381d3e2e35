"""One rank of the 2-process gated delta-net hybrid check (tests/integrations/megatron/test_gdn.py): gloo with a
``file://`` rendezvous, megatron's TP = 2 groups, zorro vs megatron's ordinary forward on the tiny fp64 Qwen3.5-shaped
hybrid (:func:`tests.support.megatron_gdn.build_hybrid_gpt`: a gated delta-net layer, then gated attention) with
TP = 2 and TP = 2 + sequence parallelism, prompt and prefix-tree plans.

Run as ``python -m tests.support.megatron_gdn_ranks RANK WORLD INIT_FILE OUT_JSON``. Each case returns this rank's
maximum differences (log-probs, entropy, relative gradient of the rank's shards; norms under SP summed over TP as
megatron's ``finalize_model_grads`` does), whether the two ranks returned identical log-probs and this rank's local
gated delta-net value heads.
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
    from tests.support import megatron_gdn as G

    M.init_megatron(rank, world, init_file)
    out = {}
    for name, sp, sharing in CASES:
        stock = G.build_hybrid_gpt(zorro=False, sequence_parallel=sp)
        zorro = G.build_hybrid_gpt(zorro=True, sequence_parallel=sp, parallel_output=True)
        zorro.load_state_dict(stock.state_dict())
        ids, am, R = M.make_batch(shared_prefix=sharing == "prefix")
        s = M.stock_outputs(stock, ids, am, R, tp_multiple=world if sp else 1)
        lp, ent, plan = M.zorro_outputs(zorro, ids, am, R, sharing=sharing)
        res = M.compare(s, (lp, ent), M.grads(stock), M.grads(zorro))
        both = [torch.empty_like(lp) for _ in range(world)]
        dist.all_gather(both, lp)
        res["ranks_equal"] = bool(all(torch.equal(both[0], x) for x in both))
        res["T"] = plan.T
        res["ordinary_tokens"] = plan.ordinary_tokens
        res["sp"] = bool(zorro.config.sequence_parallel)
        res["v_heads_local"] = zorro.decoder.layers[0].self_attention.num_v_heads_local_tp
        res["prefix_tree"] = plan.tree is not None
        out[name] = res
    dist.barrier()
    return out


if __name__ == "__main__":
    rank_main(run_rank)
