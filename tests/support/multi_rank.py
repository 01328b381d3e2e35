"""Launch one Python process per rank of a gloo group and collect each rank's JSON result (the multi-process verl
engine tests). A hang fails the test (timeout) instead of blocking the suite."""

from __future__ import annotations

import json
import os
import subprocess
import sys

__all__ = ["run_ranks", "rank_main", "first_metric"]


def run_ranks(module: str, world: int, args: list, tmp_path, timeout_s: int) -> list:
    """Run ``python -m module RANK WORLD INIT_FILE *args OUT_JSON`` for every rank (repository first on
    ``PYTHONPATH``, one thread each); returns the ranks' JSON results in rank order. Fails the calling test (with
    the log tail) on a timeout or a non-zero exit."""
    import pytest

    from tests.support import REPO_ROOT

    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    init = tmp_path / "rendezvous"
    procs, outs, logs = [], [], []
    for rank in range(world):
        out, log = tmp_path / f"rank{rank}.json", tmp_path / f"rank{rank}.log"
        with open(log, "w") as f:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", module, str(rank), str(world), str(init), *map(str, args), str(out)],
                cwd=REPO_ROOT, env=env, stdout=f, stderr=subprocess.STDOUT))
        outs.append(out)
        logs.append(log)
    try:
        for p in procs:
            p.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"the {world} ranks did not finish within {timeout_s} s (a collective hang?); rank 0 log:\n"
                    f"{logs[0].read_text()[-3000:]}")
    for rank, p in enumerate(procs):
        assert p.returncode == 0, logs[rank].read_text()[-4000:]
    return [json.loads(o.read_text()) for o in outs]


def rank_main(run_rank, *arg_types) -> None:
    """The ``__main__`` of a rank script launched by :func:`run_ranks`: parses ``RANK WORLD INIT_FILE *args
    OUT_JSON`` (``args`` converted by ``arg_types``), calls ``run_rank(rank, world, init_file, *args)`` and writes its
    result to ``OUT_JSON``."""
    rank, world, init_file, *rest = sys.argv[1:]
    *args, out = rest
    assert len(args) == len(arg_types), f"expected {len(arg_types)} arguments after INIT_FILE, got {args}"
    result = run_rank(int(rank), int(world), init_file, *(t(a) for t, a in zip(arg_types, args)))
    with open(out, "w") as f:
        json.dump(result, f)
    # the result is on disk: leave without the interpreter's teardown, where torch's C++ threads (gloo) can abort a
    # finished rank ("terminate called without an active exception", seen once on a loaded machine)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def first_metric(v):
    """A metric as an engine returns it (a value, or a list of one per micro-batch / rank; tensors or floats) ->
    its first value as a Python number (for a rank's JSON result); an empty list -> None."""
    import torch

    if isinstance(v, (list, tuple)):
        v = v[0] if v else None
    if isinstance(v, torch.Tensor):
        v = v.item()
    return v
