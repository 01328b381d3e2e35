"""One rank of the 2-process Megatron check (tests/integrations/megatron/test_gpt_step.py): gloo with a ``file://``
rendezvous, megatron's TP = 2 groups, and every 2-rank case in the same two processes (importing megatron-core costs
12-40 s per process): zorro vs megatron's ordinary forward with TP = 2, and with TP = 2 + sequence parallelism (the
packed row padded to a multiple of 2), prompt and prefix-tree plans.

Run as ``python -m tests.support.megatron_ranks RANK WORLD INIT_FILE OUT_JSON``. Each case returns this rank's
maximum differences (log-probs, entropy, relative gradient of the rank's shards) and whether the two ranks returned
identical log-probs. Then the vocabulary-parallel log-prob function alone against the project's full-vocabulary
one (every temperature op). Last, the same two processes as PP = 2 stages (the model-parallel groups rebuilt):
stock vs zorro through megatron's pipeline schedule.
"""

from __future__ import annotations

import warnings

import torch

from tests.support.multi_rank import rank_main

#: (name, sequence parallel, sharing, head through an output_layer wrap as on megatron-core < 0.19)
CASES = [("tp2", False, "prompt", False), ("tp2_sp", True, "prompt", False), ("tp2_sp_prefix", True, "prefix", False),
         ("tp2_sp_wrap", True, "prompt", True)]


def run_rank(rank: int, world: int, init_file: str) -> dict:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    import torch.distributed as dist

    from tests.support import megatron_cpu as M

    M.init_megatron(rank, world, init_file)
    from zorro_verl.integrations.megatron import step

    detected = step.has_output_processor
    out = {}
    for name, sp, sharing, wrap in CASES:
        step.has_output_processor = (lambda: False) if wrap else detected
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
    step.has_output_processor = detected
    out["vocab_parallel"] = _vocab_parallel(rank, world)
    M.init_megatron(rank, world, init_file, pipeline=world)  # the same processes, now as PP = 2 stages
    out["pp2"] = _pipeline(rank)
    dist.barrier()
    return out


def _pipeline(rank: int) -> dict:
    """PP = 2 (one layer per stage) through megatron's pipeline schedule (p2p over gloo), two micro-batches of
    different lengths (``variable_seq_lengths=True``, as verl runs it): the stock per-row batches ``[B, L]`` vs zorro's
    packed rows (:func:`zorro_gpt_forward` as the stage forward, :func:`zorro_gpt_logprobs` in the last stage's
    loss). Each stage compares its own gradients; the last stage also the log-probs / entropy."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from tests.support import megatron_cpu as M
    from zorro_verl.integrations.megatron import zorro_gpt_forward, zorro_gpt_logprobs, zorro_gpt_step
    from zorro_verl.packing import build_plan

    stock = M.build_gpt(zorro=False, parallel_output=False, pipeline=2)
    zorro = M.build_gpt(zorro=True, pipeline=2)
    zorro.load_state_dict(stock.state_dict())
    for m in (stock, zorro):
        m.config.variable_seq_lengths = True  # the micro-batches' lengths differ (stock: L; zorro: T)
    batches = [M.make_batch(), M.make_batch(seed=4, shared_prefix=True)]
    plans = [build_plan(ids, am, R) for ids, am, R in batches]
    assert plans[0].T != plans[1].T
    got = {"stock": [], "zorro": []}

    def loss_of(lp, ent):
        loss = (lp * M.loss_weights(lp.numel())).sum() + M.LOSS_ENT_WEIGHT * ent.sum()
        return loss, {}

    def stock_step(it, model):
        rows = M._rows(*next(it))
        L = max(len(t) for t, _, _ in rows)
        batch = torch.zeros(len(rows), L, dtype=torch.long)
        for b, (t, _, _) in enumerate(rows):
            batch[b, :len(t)] = t
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
        plan = next(it)  # every stage builds (here: takes) the same plan for the micro-batch
        out = zorro_gpt_forward(model, plan)

        def loss_func(logits):  # [N, 1, V] on the last stage
            lp, ent = zorro_gpt_logprobs(model, plan, logits, calculate_entropy=True)
            got["zorro"].append((lp.detach(), ent.detach()))
            return loss_of(lp, ent)

        return out, loss_func

    try:  # a stage is not a whole model: the one-call step refuses, naming the split API
        zorro_gpt_step(zorro, plans[0])
        refused = False
    except ValueError as e:
        refused = "zorro_gpt_forward" in str(e)
    fb = get_forward_backward_func()
    with M.cuda_as_cpu():  # seq_length / micro_batch_size: unused with variable_seq_lengths (shapes are exchanged)
        fb(forward_step_func=stock_step, data_iterator=iter(batches), model=[stock], num_microbatches=2,
           seq_length=0, micro_batch_size=0, forward_only=False)
        fb(forward_step_func=zorro_step, data_iterator=iter(plans), model=[zorro], num_microbatches=2,
           seq_length=0, micro_batch_size=0, forward_only=False)
    last = parallel_state.is_pipeline_last_stage()
    cat = (lambda xs: (torch.cat([x[0] for x in xs]), torch.cat([x[1] for x in xs]))) if last else \
        (lambda xs: (torch.zeros(1), torch.zeros(1)))
    res = M.compare(cat(got["stock"]), cat(got["zorro"]), M.grads(stock), M.grads(zorro))
    res.update(stage=parallel_state.get_pipeline_model_parallel_rank(), last=last, T=[p.T for p in plans],
               rank=rank, step_refused=refused)
    return res


def _vocab_parallel(rank: int, world: int) -> dict:
    """vocab_parallel_logprobs on this rank's slice vs the project's logits_logprobs on the whole vocabulary (the
    same seeded fp64 logits on both ranks), every temperature op at T = 0.7 and T = 1, with and without a chunk
    smaller than the rows: worst value / gradient difference (the gradient on this rank's columns)."""
    from megatron.core import parallel_state

    from zorro_verl.integrations.megatron.vocab_parallel import vocab_parallel_logprobs
    from zorro_verl.logprob import TEMPERATURE_OPS, logits_logprobs

    g = torch.Generator().manual_seed(11)
    N, V = 13, 40
    full = torch.randn(N, V, generator=g, dtype=torch.float64) * 3
    targets = torch.randint(0, V, (N,), generator=g)
    w_lp, w_ent = torch.rand(N, generator=g, dtype=torch.float64), torch.rand(N, generator=g, dtype=torch.float64)
    width = V // world
    group = parallel_state.get_tensor_model_parallel_group()
    worst = {"logprob": 0.0, "entropy": 0.0, "grad": 0.0, "cases": 0}
    for op in TEMPERATURE_OPS:
        for temp in (0.7, 1.0):
            for chunk in (4, 1024):
                ref_in = full.clone().requires_grad_(True)
                lp_r, ent_r = logits_logprobs(ref_in, targets, temperature=temp, calculate_entropy=True,
                                              temperature_op=op)
                ((lp_r * w_lp).sum() + (ent_r * w_ent).sum()).backward()
                mine = full[:, rank * width:(rank + 1) * width].clone().requires_grad_(True)
                lp, ent = vocab_parallel_logprobs(mine, targets, group=group, vocab_start=rank * width,
                                                  temperature=temp, calculate_entropy=True, chunk_size=chunk,
                                                  temperature_op=op)
                ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
                worst["logprob"] = max(worst["logprob"], (lp - lp_r).abs().max().item())
                worst["entropy"] = max(worst["entropy"], (ent - ent_r).abs().max().item())
                ref_g = ref_in.grad[:, rank * width:(rank + 1) * width]
                worst["grad"] = max(worst["grad"], ((mine.grad - ref_g).abs().max() / ref_g.abs().max()).item())
                worst["cases"] += 1
    return worst


if __name__ == "__main__":
    rank_main(run_rank)
