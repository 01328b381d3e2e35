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

import importlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["run_verl_fsdp", "run_rank", "REPO_HINT"]

REPO_HINT = ("run from a repository checkout: PYTHONPATH=<repo> .venv/bin/python -m zorro_verl.bench --long "
             "(the engines' builder and the CPU shims live in its tests/support)")


def _support(name: str):
    try:
        return importlib.import_module(f"tests.support.{name}")
    except ImportError as e:
        raise RuntimeError(f"--long: the repository's test support (tests/support/{name}.py, not part of the "
                           f"package) could not be imported ({e}); {REPO_HINT}") from None


def _repo_root() -> Path:
    root = Path(__file__).resolve().parents[2]
    if not (root / "tests" / "support" / "verl_engines.py").is_file():
        raise RuntimeError(f"--long: zorro_verl is imported from {root}, which is not a repository checkout; "
                           f"{REPO_HINT}")
    return root


def run_verl_fsdp(sc, settings: dict, cfg, rows: list) -> dict:
    """The measured dict of :func:`~zorro_verl.bench.long_context.long_row` for one scenario (rank 0's times;
    every rank's counts): the model of config ``cfg`` (random weights), the batch of ``rows`` (``[(prompt ids,
    response ids)]``)."""
    import torch

    root = _repo_root()
    degree = int(settings["degree"])
    with tempfile.TemporaryDirectory(prefix="zorro-long-") as tmp:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        model.config.architectures = [type(model).__name__]
        model.save_pretrained(os.path.join(tmp, "ckpt"))
        del model
        spec = {**settings, "ckpt": os.path.join(tmp, "ckpt"), "rows": rows, "budget": sc.budget}
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        procs, outs, logs = [], [], []
        for rank in range(degree):
            out, log = os.path.join(tmp, f"rank{rank}.json"), os.path.join(tmp, f"rank{rank}.log")
            with open(log, "w") as f:
                procs.append(subprocess.Popen([sys.executable, "-m", "zorro_verl.bench.long_verl", str(rank),
                                               str(degree), os.path.join(tmp, "init"), spec_path, out],
                                              cwd=root, env=env, stdout=f, stderr=subprocess.STDOUT))
            outs.append(out)
            logs.append(log)
        try:
            for p in procs:
                p.wait(timeout=settings["timeout_s"])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise RuntimeError(f"--long: the {degree} ranks did not finish within {settings['timeout_s']} s; rank 0 "
                               f"log:\n{Path(logs[0]).read_text()[-3000:]}") from None
        for rank, p in enumerate(procs):
            if p.returncode != 0:
                raise RuntimeError(f"--long: rank {rank} exited with {p.returncode}:\n"
                                   f"{Path(logs[rank]).read_text()[-4000:]}")
        results = [json.loads(Path(o).read_text()) for o in outs]
    m = results[0]
    for side in ("stock", "zorro"):
        m[side]["rank_tokens"] = [r[side]["rank_tokens"] for r in results]
        m[side]["comm_bytes"] = [r[side]["comm_bytes"] for r in results]
    return m


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
        _support("verl_cpu_platform").use_cpu_platform()
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    if not cuda:
        # stock's two GPU kernels, as they cost on a GPU (tests/support/cpu_stock_kernels.py): flash varlen attention
        # per packed row (not all T^2 pairs of the micro-batch under a mask) and blocked log-probs (not verl's
        # per-token Python loop); zorro's engine calls neither
        ul, kernels = _support("verl_ulysses"), _support("cpu_stock_kernels")
        ul.install_cpu_varlen()
        from verl.models.transformers import monkey_patch
        from verl.workers.engine.fsdp import transformer_impl

        monkey_patch._flash_attention_forward = kernels.flash_varlen_kernel
        kernels.use_blocked_logprobs(transformer_impl)
        stock_attn = ul.CPU_VARLEN_ATTN
    import verl.workers.engine  # noqa: F401  (registers the zorro engine)

    eng = _support("verl_engines")
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
    names = list(engines)
    res = {k: {"train_ms": [], "infer_ms": []} for k in names}
    log_probs = {}
    for i in range(int(spec["warmup"]) + int(spec["reps"])):
        timed = i >= int(spec["warmup"])
        for name in names[i % 2:] + names[:i % 2]:  # each side first in every other run
            e = engines[name]
            dist.barrier()
            t0 = clock.now()
            with e.eval_mode():
                out = e.infer_batch(td.clone(), loss_function=None)
            t1 = clock.now()
            if i == 0:
                log_probs[name] = eng.response_values(out["model_output"]["log_probs"], td)[mask]
                counters.start()
            dist.barrier()
            t2 = clock.now()
            with e.train_mode():
                e.train_batch(td.clone(), loss_function=loss)
            t3 = clock.now()
            if i == 0:
                counters.on = False
                res[name].update(comm_bytes=counters.bytes, rank_tokens=counters.tokens)
                if name == "stock":
                    res[name]["mb_tokens"] = counters.mb_tokens
                else:
                    zmb = e.zorro_last_micro_batches
                    res[name].update(mb_tokens=[int(c) for c in zmb.costs], mb_rows=[list(b) for b in zmb.batches])
            if timed:
                res[name]["infer_ms"].append((t1 - t0) * 1e3)
                res[name]["train_ms"].append((t3 - t2) * 1e3)
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
    rank, world, init_file, spec_path, out_path = sys.argv[1:]
    result = run_rank(int(rank), int(world), init_file, spec_path)
    with open(out_path, "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the result is on disk: skip the teardown where gloo's threads can abort a finished rank
