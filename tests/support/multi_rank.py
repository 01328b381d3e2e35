"""Launch one Python process per rank of a gloo group and collect each rank's JSON result (the multi-process verl
engine tests). A hang fails the test (timeout) instead of blocking the suite."""

from __future__ import annotations

import json
import os
import subprocess
import sys

__all__ = ["run_ranks"]


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
