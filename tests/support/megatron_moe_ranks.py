"""One rank of the 2-process MoE check (tests/integrations/megatron/test_moe.py): gloo with a ``file://`` rendezvous,
then in the same two processes (megatron-core's import costs 12-40 s each):

* TP = 2 + sequence parallelism (the allgather dispatcher), prompt and prefix-tree plans: each rank's router sees its
  half of the packed row (zorro's: padded to a multiple of 2), the same batch on both ranks;
* EP = 2 (TP = 1, the model-parallel groups rebuilt): two local experts per rank, megatron's all-to-all dispatcher
  over gloo (CPU shims M1 + streams, :func:`tests.support.megatron_moe.alltoall_cpu_shims`), a different batch per
  rank, so the expert gradients and the global-batch statistics (all-reduced over the data-parallel ranks) combine
  both ranks' tokens.

Then PP = 2 (megatron's pipeline schedule, two micro-batches). With 4 processes instead: TP = 2 + SP x
EP = 2 (2 data-parallel ranks, the all-to-all dispatcher).

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
    M.init_megatron(rank, world, init_file, pipeline=world)  # and as PP = 2 stages
    out["pp2"] = _pipeline()
    dist.barrier()
    return out


def _pipeline() -> dict:
    """PP = 2 (one MoE layer per stage) through megatron's pipeline schedule, two micro-batches of different lengths
    (``variable_seq_lengths``): the stock per-row batches vs zorro's packed rows (:func:`zorro_gpt_forward` on each
    stage, every stage with the same plan). The global-batch loss accumulates over both micro-batches, the expert
    bias counts too; each stage compares its own gradients, metrics and routers, the last stage also the outputs."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from tests.support import megatron_cpu as M
    from tests.support import megatron_moe as MM
    from zorro_verl.integrations.megatron import zorro_gpt_forward, zorro_gpt_logprobs
    from zorro_verl.packing import build_plan

    kw = {"moe": True, "moe_overrides": MM.STATS, "config_hook": MM.expert_bias_on, "pipeline": 2}
    stock = M.build_gpt(zorro=False, parallel_output=False, **kw)
    zorro = M.build_gpt(zorro=True, **kw)
    zorro.load_state_dict(stock.state_dict())
    for m in (stock, zorro):
        m.config.variable_seq_lengths = True
    batches = [MM.make_uniform_batch(), MM.make_uniform_batch(seed=4, L=12, shared_prefix=True)]
    plans = [build_plan(*b) for b in batches]
    got = {"stock": [], "zorro": []}

    def loss_of(lp, ent):
        return (lp * M.loss_weights(lp.numel())).sum() + M.LOSS_ENT_WEIGHT * ent.sum(), {}

    def stock_step(it, model):
        ids, am, R = next(it)
        Pw = ids.shape[1] - R
        rows = [(ids[b][am[b].bool()], int(am[b, :Pw].sum()), int(am[b, Pw:].sum())) for b in range(ids.shape[0])]
        L = len(rows[0][0])  # every row L tokens: no padding
        batch = torch.stack([t for t, _, _ in rows])
        mask = torch.triu(torch.ones(L, L, dtype=torch.bool), 1).view(1, 1, L, L)
        out = model(input_ids=batch, position_ids=torch.arange(L)[None].expand(len(rows), L), attention_mask=mask)

        def loss_func(logits):  # [B, L, V] on the last stage
            lps, ents = [], []
            for b, (t, p, r) in enumerate(rows):
                if r:
                    logp = torch.log_softmax(logits[b, p - 1:p + r - 1], -1)
                    lps.append(logp.gather(-1, t[p:p + r, None])[:, 0])
                    ents.append(-(logp.exp() * logp).sum(-1))
            got["stock"].append((torch.cat(lps).detach(), torch.cat(ents).detach()))
            return loss_of(torch.cat(lps), torch.cat(ents))

        return out, loss_func

    def zorro_step(it, model):
        plan = next(it)
        out = zorro_gpt_forward(model, plan)

        def loss_func(logits):
            lp, ent = zorro_gpt_logprobs(model, plan, logits, calculate_entropy=True)
            got["zorro"].append((lp.detach(), ent.detach()))
            return loss_of(lp, ent)

        return out, loss_func

    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    # the schedule sets the aux-loss gradient scale (1 / micro-batches) into a [1] tensor; the cases before this
    # one, run without a schedule, left megatron's default () scalar there
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    fb = get_forward_backward_func()
    side = {}
    for name, model, step, data in (("stock", stock, stock_step, batches), ("zorro", zorro, zorro_step, plans)):
        MM.reset_statistics(model)
        with M.cuda_as_cpu():
            fb(forward_step_func=step, data_iterator=iter(data), model=[model], num_microbatches=2, seq_length=0,
               micro_batch_size=0, forward_only=False)
        side[name] = MM.collect(model)
    last = parallel_state.is_pipeline_last_stage()
    for name in side:
        xs = got[name]
        side[name]["lp"] = torch.cat([x[0] for x in xs]) if last else torch.zeros(1)
        side[name]["ent"] = torch.cat([x[1] for x in xs]) if last else torch.zeros(1)
    res = MM.compare_moe(side["stock"], side["zorro"])
    res.update(deduplicated=all(p.T < p.ordinary_tokens for p in plans), last=last,
               stage=parallel_state.get_pipeline_model_parallel_rank())
    return res


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
