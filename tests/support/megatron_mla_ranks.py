"""One rank of the 2-process multi-latent-attention check (tests/integrations/megatron/test_mla.py): gloo with a
``file://`` rendezvous, megatron's TP = 2 groups, zorro vs megatron's ordinary forward on a tiny fp64 MLA model
(``build_gpt(mla=True)``) with TP = 2 and TP = 2 + sequence parallelism, RoPE and YaRN, prompt and prefix-tree plans.

Run as ``python -m tests.support.megatron_mla_ranks RANK WORLD INIT_FILE OUT_JSON``. Each case returns this rank's
maximum differences (log-probs, entropy, relative gradient of the rank's shards) and whether the two ranks returned
identical log-probs.
"""

from __future__ import annotations

import warnings

import torch

from tests.support.multi_rank import rank_main

#: (name, sequence parallel, sharing, rope_type, q_lora_rank); without q_lora_rank no norms on the compressed q / kv
#: (megatron refuses a q norm it would not use)
CASES = [("tp2_rope", False, "prompt", "rope", 24), ("tp2_sp_yarn", True, "prompt", "yarn", 24),
         ("tp2_sp_yarn_prefix", True, "prefix", "yarn", 24), ("tp2_sp_rope_no_q_lora", True, "prompt", "rope", None)]


def run_rank(rank: int, world: int, init_file: str) -> dict:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    import torch.distributed as dist

    from tests.support import megatron_cpu as M

    M.init_megatron(rank, world, init_file)
    out = {}
    for name, sp, sharing, rope_type, q_lora_rank in CASES:
        kw = {"mla": True, "rope_type": rope_type, "q_lora_rank": q_lora_rank, "qk_layernorm": q_lora_rank is not None,
              "sequence_parallel": sp}
        stock = M.build_gpt(zorro=False, parallel_output=False, **kw)
        zorro = M.build_gpt(zorro=True, **kw)
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
        res["heads_local"] = zorro.decoder.layers[0].self_attention.num_attention_heads_per_partition
        out[name] = res
    dist.barrier()
    return out


if __name__ == "__main__":
    rank_main(run_rank)
