"""What the long-context engine runs (:mod:`.long_verl`, :mod:`.long_megatron`) share: the launcher of their rank
processes, the interleaved timing of the two engines on each rank, and the rank process's entry point.

:func:`launch_ranks` saves the model (random weights) as a checkpoint, writes the rows and the settings to a spec
file and starts ``degree`` processes (``python -m MODULE RANK WORLD INIT_FILE SPEC OUT``; a ``file://`` rendezvous,
no port), then returns rank 0's measured dict with every rank's counts. :func:`interleaved_runs` times one inference
pass and one training step of each engine, run by run and interleaved, a barrier before each timed call.
:func:`rank_entry` runs a module's ``run_rank`` and writes its result. Both runs need the repository checkout (their
engine builders and CPU shims live in its ``tests/support``, never shipped): :func:`support` imports from there.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

__all__ = ["REPO_HINT", "support", "launch_ranks", "interleaved_runs", "rank_entry"]

REPO_HINT = ("run from a repository checkout: PYTHONPATH=<repo> .venv/bin/python -m zorro_verl.bench --long "
             "(the engines' builder and the CPU shims live in its tests/support)")


def support(name: str):
    """``tests.support.NAME`` of the repository checkout (RuntimeError with :data:`REPO_HINT` when absent)."""
    try:
        return importlib.import_module(f"tests.support.{name}")
    except ImportError as e:
        raise RuntimeError(f"--long: the repository's test support (tests/support/{name}.py, not part of the "
                           f"package) could not be imported ({e}); {REPO_HINT}") from None


def _repo_root(support_file: str) -> Path:
    root = Path(__file__).resolve().parents[2]
    if not (root / "tests" / "support" / support_file).is_file():
        raise RuntimeError(f"--long: zorro_verl is imported from {root}, which is not a repository checkout; "
                           f"{REPO_HINT}")
    return root


def launch_ranks(module: str, support_file: str, sc, settings: dict, cfg, rows: list) -> dict:
    """Run ``module``'s ranks on one scenario (``settings["degree"]`` processes) and return the measured dict of
    :func:`~zorro_verl.bench.long_context.long_row`: rank 0's, with each side's ``rank_tokens`` / ``comm_bytes`` the
    lists over the ranks. ``cfg``: the model's config (random weights); ``rows``: ``[(prompt ids, response ids)]``;
    ``support_file``: the test-support file the ranks import (checked present: a repository checkout)."""
    import torch

    root = _repo_root(support_file)
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
                procs.append(subprocess.Popen([sys.executable, "-m", module, str(rank), str(degree),
                                               os.path.join(tmp, "init"), spec_path, out],
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


def interleaved_runs(engines: dict, td, loss, spec: dict, clock, first_infer: Callable, first_train: Callable,
                     start_counting: Callable) -> dict:
    """Time ``spec["warmup"] + spec["reps"]`` runs of each engine (``{"stock": e, "zorro": e}``), each side first in
    every other run, a barrier before each timed call: one ``infer_batch`` and one ``train_batch`` (``loss``) on a
    clone of ``td``. In the first (warm-up) run: ``first_infer(name, output)`` after the inference pass,
    ``start_counting()`` before the training step and ``first_train(name, engine) -> dict`` after it (merged into the
    side's result). Returns ``{name: {"train_ms": [...], "infer_ms": [...], ...}}`` (the timed runs)."""
    import torch.distributed as dist

    names = list(engines)
    res = {k: {"train_ms": [], "infer_ms": []} for k in names}
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
                first_infer(name, out)
                start_counting()
            dist.barrier()
            t2 = clock.now()
            with e.train_mode():
                e.train_batch(td.clone(), loss_function=loss)
            t3 = clock.now()
            if i == 0:
                res[name].update(first_train(name, e))
            if timed:
                res[name]["infer_ms"].append((t1 - t0) * 1e3)
                res[name]["train_ms"].append((t3 - t2) * 1e3)
    return res


def rank_entry(run_rank: Callable) -> None:
    """A rank process's main: ``run_rank(rank, world, init_file, spec_path)`` from ``sys.argv``, its result written
    to the last argument as JSON."""
    rank, world, init_file, spec_path, out_path = sys.argv[1:]
    result = run_rank(int(rank), int(world), init_file, spec_path)
    with open(out_path, "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the result is on disk: skip the teardown where gloo's threads can abort a finished rank
