"""The ``verl-fsdp`` long-context run (:mod:`zorro_verl.bench.long_context`): verl 0.9's stock FSDP engine and the
zorro engine, both under Ulysses SP, one process per rank.

:func:`run_verl_fsdp` (the launcher; ``long_context`` calls it with the config and the rows, this module imports
nothing of it) saves the model (random weights) as a checkpoint, writes the rows and the settings to a spec file and
starts ``degree`` processes (``python -m zorro_verl.bench.long_verl RANK WORLD INIT_FILE SPEC OUT``; a ``file://``
rendezvous, gloo on CPU, NCCL on CUDA, one rank per GPU). Each rank (:func:`run_rank`) builds both engines (FSDP2
over all ranks = one SP group; fp32 on CPU, verl's bf16 mixed precision on CUDA; gradient checkpointing as set;
AdamW at lr 0, so every step runs on the same weights), the same jagged verl batch on every rank, dynamic
micro-batches at the scenario's per-GPU budget, and times, run by run and interleaved, one inference pass and one
training step of each (a barrier before each timed call). In the first (warm-up) run it counts, per training step:
the bytes the rank hands to ``torch.distributed.all_to_all`` (a wrapper), the tokens its model forward embeds (a
pre-hook on the input embeddings), stock's micro-batches (a wrapper of verl's ``prepare_micro_batches``) and zorro's
(``zorro_last_micro_batches``); and the log-probs of both.

Stock's Ulysses attention is verl's own path (its all-to-all, position all-gather, varlen boundaries). On CUDA its
kernel is flash-attention 2; on the CPU the one flash-attn kernel call inside it is replaced by a plain-torch
stand-in that computes what flash varlen computes (each packed row's causal attention alone,
``tests.support.cpu_stock_kernels.flash_varlen_kernel``), verl's per-token log-prob fallback by blocked log-probs
(the e2e benchmark's stand-ins for stock's GPU kernels), and verl runs on its CPU platform
(``tests.support.verl_cpu_platform``): a CPU run needs the repository checkout on ``PYTHONPATH``. The engines are
built by ``tests.support.verl_engines.build_engine`` (the engine tests' builder) on both devices.
"""

from __future__ import annotations

import json
import os

from zorro_verl.bench.long_ranks import interleaved_runs, launch_ranks, rank_entry, support

__all__ = ["run_verl_fsdp", "run_rank"]


def run_verl_fsdp(sc, settings: dict, cfg, rows: list) -> dict:
    """The measured dict of :func:`~zorro_verl.bench.long_context.long_row` for one scenario (rank 0's times;
    every rank's counts): the model of config ``cfg`` (random weights), the batch of ``rows`` (``[(prompt ids,
    response ids)]``)."""
    return launch_ranks("zorro_verl.bench.long_verl", "verl_engines.py", sc, settings, cfg, rows)


class _Counters:
    """Per training step: bytes handed to ``all_to_all``, tokens embedded, stock's micro-batch tokens."""

    def __init__(self):
        import torch.distributed as dist
        from verl.workers.engine.fsdp import transformer_impl

        self.on = False
        self.bytes = self.tokens = 0
        self.mb_tokens: list[int] = []
        a2a, prep = dist.all_to_all, transformer_impl.prepare_micro_batches

        def counted(output_list, input_list, *args, **kwargs):
            if self.on:
                self.bytes += sum(t.numel() * t.element_size() for t in input_list)
            return a2a(output_list, input_list, *args, **kwargs)

        def prepare(data, *args, **kwargs):
            mbs, idx = prep(data, *args, **kwargs)
            if self.on:
                self.mb_tokens += [int(mb["input_ids"].offsets()[-1]) for mb in mbs]
            return mbs, idx

        dist.all_to_all = counted
        transformer_impl.prepare_micro_batches = prepare

    def hook(self, _module, args):
        if self.on:
            self.tokens += int(args[0].numel())

    def start(self) -> None:
        self.bytes = self.tokens = 0
        self.mb_tokens = []
        self.on = True


def run_rank(rank: int, world: int, init_file: str, spec_path: str) -> dict:
    with open(spec_path) as f:
        spec = json.load(f)
    cuda = spec["device"].startswith("cuda")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    if not cuda:
        os.environ.update(VERL_ENGINE_DEVICE="cpu", OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    from zorro_verl.bench.timing import Clock
    from zorro_verl.testing import batch_from_rows

    if cuda:
        torch.cuda.set_device(rank)
        stock_attn = "flash_attention_2"
    else:
        torch.set_num_threads(1)
        support("verl_cpu_platform").use_cpu_platform()
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    if not cuda:
        # stock's two GPU kernels, as they cost on a GPU (tests/support/cpu_stock_kernels.py): flash varlen attention
        # per packed row (not all T^2 pairs of the micro-batch under a mask) and blocked log-probs (not verl's
        # per-token Python loop); zorro's engine calls neither
        ul, kernels = support("verl_ulysses"), support("cpu_stock_kernels")
        ul.install_cpu_varlen()
        from verl.models.transformers import monkey_patch
        from verl.workers.engine.fsdp import transformer_impl

        monkey_patch._flash_attention_forward = kernels.flash_varlen_kernel
        kernels.use_blocked_logprobs(transformer_impl)
        stock_attn = ul.CPU_VARLEN_ATTN
    import verl.workers.engine  # noqa: F401  (registers the zorro engine)

    eng = support("verl_engines")
    counters = _Counters()
    sp, budget = int(spec["degree"]), int(spec["budget"])
    rows = [(p, r) for p, r in spec["rows"]]
    td = eng.make_engine_batch(base=batch_from_rows(rows, include_training_fields=True, seed=1), temperature=1.0,
                               calculate_entropy=False, use_dynamic_bsz=True, max_token_len=budget,
                               global_batch_size=len(rows))
    mask = td["response_mask"].bool()
    common = dict(use_dynamic_bsz=True, max_token_len=budget, lr=0.0, gradient_checkpointing=bool(spec["grad_ckpt"]),
                  engine_overrides={"ulysses_sequence_parallel_size": sp},
                  compute_dtype="bf16" if spec["dtype"] == "bfloat16" else "fp32")
    engines = {"stock": eng.build_engine(spec["ckpt"], zorro=False, attn_implementation=stock_attn, **common),
               "zorro": eng.build_engine(spec["ckpt"], zorro=True,
                                         zorro_settings={"attention_backend": spec["backend"]}, **common)}
    for e in engines.values():
        e.module.get_input_embeddings().register_forward_pre_hook(counters.hook)
    loss = eng.ppo_loss_fn()
    clock = Clock(spec["clock"], cuda)
    log_probs = {}

    def first_infer(name, out):
        log_probs[name] = eng.response_values(out["model_output"]["log_probs"], td)[mask]

    def first_train(name, e):
        counters.on = False
        if name == "stock":
            return dict(comm_bytes=counters.bytes, rank_tokens=counters.tokens, mb_tokens=counters.mb_tokens)
        zmb = e.zorro_last_micro_batches
        return dict(comm_bytes=counters.bytes, rank_tokens=counters.tokens, mb_tokens=[int(c) for c in zmb.costs],
                    mb_rows=[list(b) for b in zmb.batches])

    res = interleaved_runs(engines, td, loss, spec, clock, first_infer, first_train, counters.start)
    from zorro_verl.integrations.verl.v09.batching import row_group_ids, row_lengths

    p, r = row_lengths(td)
    dev = torch.device("cuda" if cuda else "cpu")
    from zorro_verl.bench.report import device_name

    out = {**res, "sharding": "sp", "degree": sp, "clock": spec["clock"], "device": device_name(dev),
           "element_size": 2 if spec["dtype"] == "bfloat16" else 4, "recompute": bool(spec["grad_ckpt"]),
           "p_len": p.tolist(), "r_len": r.tolist(), "group": row_group_ids(td, p).tolist(),
           "logprob_max_abs_diff": (log_probs["stock"].float() - log_probs["zorro"].float()).abs().max().item(),
           "logprob_max_abs": log_probs["stock"].float().abs().max().item(), "logprob_count": int(mask.sum())}
    dist.barrier()
    dist.destroy_process_group()
    return out


if __name__ == "__main__":
    rank_entry(run_rank)
