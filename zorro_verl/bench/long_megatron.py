"""The ``verl-megatron`` long-context run (:mod:`zorro_verl.bench.long_context`): verl 0.9's stock Megatron engine
and the zorro engine, both under context parallelism (CP), one process per rank.

:func:`run_verl_megatron` (the launcher) saves the model (random weights) as a checkpoint, writes the rows and the
settings to a spec file and starts ``degree`` processes (``python -m zorro_verl.bench.long_megatron RANK WORLD
INIT_FILE SPEC OUT``; a ``file://`` rendezvous, gloo on CPU, NCCL on CUDA, one rank per GPU). Each rank
(:func:`run_rank`) builds both engines through Megatron-Bridge (verl's default builder) at ``context_parallel_size =
degree`` (TP = PP = 1, so DP = 1: one CP group), verl's packed (THD) path for stock, the same jagged batch on every
rank, dynamic micro-batches at the scenario's per-GPU budget (verl's Megatron engine multiplies it by CP), and times,
run by run and interleaved, one inference pass and one training step of each (a barrier before each timed call). In
the first (warm-up) run it counts, per training step: the tokens each model forward embeds (a pre-hook on the
embedding), the bytes of keys / values each rank receives from the CP all-gathers (a counting subclass of the
gather zorro's CP attention calls), each side's micro-batches (cp x what a rank embeds of each: verl's THD buffer
for stock, every row padded to ``2 cp``; zorro's packed row as its CP layout cuts it), and the log-probs of both.

Stock's CP attention is Transformer Engine's on CUDA (verl's zigzag split, TE's exchange; its bytes are not counted
there: the row takes the cost model's, flagged). On the CPU it is the test support's stand-in,
``tests.support.megatron_cp_stock.ThdCpCoreAttention`` (TE's ``all_gather`` exchange and each row's causal
attention at its zigzag positions, checked against stock at CP = 1 by the engine tests), with the CPU patches of
``tests.support.megatron_engines``: a CPU run needs the repository checkout on ``PYTHONPATH``.
"""

from __future__ import annotations

import json
import os

from zorro_verl.bench.long_ranks import interleaved_runs, launch_ranks, rank_entry, support

__all__ = ["run_verl_megatron", "run_rank"]


def run_verl_megatron(sc, settings: dict, cfg, rows: list) -> dict:
    """The measured dict of :func:`~zorro_verl.bench.long_context.long_row` for one scenario (rank 0's times;
    every rank's counts): the model of config ``cfg`` (random weights), the batch of ``rows`` (``[(prompt ids,
    response ids)]``)."""
    return launch_ranks("zorro_verl.bench.long_megatron", "megatron_engines.py", sc, settings, cfg, rows)


class _Counters:
    """Per training step: tokens embedded, bytes received by the CP K/V all-gathers (zorro's, and the CPU stand-in
    of stock's, both go through ``zorro_verl.attention.context_parallel._GatherKV``, replaced here by a counting
    subclass)."""

    def __init__(self):
        import torch.distributed as dist

        from zorro_verl.attention import context_parallel

        self.on = False
        self.bytes = 0
        self.calls: list[int] = []  # tokens of each model forward (one per micro-batch)
        base = context_parallel._GatherKV
        counters = self

        class _Counted(base):
            @staticmethod
            def forward(ctx, x, group):
                if counters.on:
                    counters.bytes += x.numel() * x.element_size() * (dist.get_world_size(group) - 1)
                return base.forward(ctx, x, group)

        context_parallel._GatherKV = _Counted

    def hook(self, _module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if self.on and ids is not None:
            self.calls.append(int(ids.numel()))

    def start(self) -> None:
        self.bytes = 0
        self.calls = []
        self.on = True


def _recompute(on: bool) -> dict:
    """Megatron's full activation recompute of every layer (the gradient checkpointing the FSDP row turns on)."""
    return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1} if on else {}


def run_rank(rank: int, world: int, init_file: str, spec_path: str) -> dict:
    with open(spec_path) as f:
        spec = json.load(f)
    cuda = spec["device"].startswith("cuda")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist

    from zorro_verl.bench.timing import Clock
    from zorro_verl.testing import batch_from_rows

    cp, budget, grad_ckpt = int(spec["degree"]), int(spec["budget"]), bool(spec["grad_ckpt"])
    rollouts = sum(1 for p, _ in spec["rows"] if p == spec["rows"][0][0])  # n: each prompt's rows
    zorro = {"enable": True, "rollout_n": rollouts, "attention_backend": spec["backend"]}
    E = support("megatron_engines")
    if cuda:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
        # Megatron-Bridge's TE spec, bf16; Adam at lr 0 (every run on the same weights)
        gpu = dict(cp=cp, max_tokens=budget, transformer_overrides=_recompute(grad_ckpt),
                   optimizer=dict(optimizer="adam", lr=0.0, total_training_steps=10, weight_decay=0.0))
        engines = {"stock": E.build_gpu_engine(spec["ckpt"], zorro=None, **gpu),
                   "zorro": E.build_gpu_engine(spec["ckpt"], zorro=zorro, **gpu)}
    else:
        E.start_rank(rank, world, init_file, spec["ckpt"])  # the CPU patches, gloo; the checkpoint exists
        common = dict(tp=1, remove_padding=True, max_tokens=budget, engine_kwargs={"context_parallel_size": cp},
                      transformer_overrides=_recompute(grad_ckpt))
        engines = {"stock": E.build_engine(spec["ckpt"], zorro=None, **common),
                   "zorro": E.build_engine(spec["ckpt"], zorro=zorro, **common)}
    eng = support("verl_engines")
    counters = _Counters()
    rows = [(p, r) for p, r in spec["rows"]]
    td = eng.make_engine_batch(base=batch_from_rows(rows, include_training_fields=True, seed=1), temperature=1.0,
                               calculate_entropy=False, use_dynamic_bsz=True, max_token_len=budget,
                               global_batch_size=len(rows))
    for e in engines.values():
        E.gpt_of(e).embedding.register_forward_pre_hook(counters.hook, with_kwargs=True)
    loss = E.ppo_loss_fn()
    clock = Clock(spec["clock"], cuda)
    log_probs = {}

    def first_infer(name, out):
        log_probs[name] = E.response_values(out["model_output"]["log_probs"], td)  # [N]

    def first_train(name, e):
        counters.on = False
        # each micro-batch's CP buffer (stock: verl's THD rows padded to 2 cp; zorro: its packed row as its CP layout
        # cuts it) is cp x what one rank embeds of it
        got = dict(comm_bytes=None if cuda and name == "stock" else counters.bytes, rank_tokens=sum(counters.calls),
                   mb_tokens=[cp * n for n in counters.calls])
        if name == "zorro":
            got["mb_rows"] = [list(b) for b in e.zorro_last_micro_batches.batches]
        return got

    res = interleaved_runs(engines, td, loss, spec, clock, first_infer, first_train, counters.start)
    from zorro_verl.integrations.verl.v09.batching import row_group_ids, row_lengths

    p, r = row_lengths(td)
    from zorro_verl.bench.report import device_name

    lp_s, lp_z = log_probs["stock"].float().cpu(), log_probs["zorro"].float().cpu()
    out = {**res, "sharding": "cp", "degree": cp, "clock": spec["clock"],
           "device": device_name(torch.device("cuda" if cuda else "cpu")),
           "element_size": 2 if cuda else 4, "recompute": grad_ckpt,
           "p_len": p.tolist(), "r_len": r.tolist(), "group": row_group_ids(td, p).tolist(),
           "logprob_max_abs_diff": (lp_s - lp_z).abs().max().item(), "logprob_max_abs": lp_s.abs().max().item(),
           "logprob_count": int(lp_s.numel())}
    dist.barrier()
    dist.destroy_process_group()
    return out


if __name__ == "__main__":
    rank_entry(run_rank)
