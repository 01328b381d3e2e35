"""The peak of the C heap in use of a training worker, for the e2e benchmark's memory target (tests/e2e only).

Why not peak RSS alone: glibc's ``malloc`` raises its mmap threshold to the size of the largest block freed so far
(up to 32 MiB), so after the first big free, tensors of that size come from the heap and stay resident when freed;
which freed blocks a process keeps then depends on the order of its allocations. Two runs of the same stock step
on the same rollouts differed by ~0.1 GiB of peak RSS on a 2-core AMD EPYC, more than the difference zorro makes.
Pinning the threshold (``MALLOC_MMAP_THRESHOLD_``) makes RSS track the bytes in use, but it also makes every large
tensor a fresh ``mmap`` with page faults, which slowed stock's update by ~40% and zorro's by ~27%: it would distort
the timings the same runs measure.

``mallinfo2()`` instead reports the bytes ``malloc`` has handed out and not got back (``uordblks``, in the arenas,
plus ``hblkhd``, in mmapped blocks): tensors live on that heap, and the count does not depend on what the allocator
keeps. With :data:`HEAP_DIR_ENV` set, :func:`start` (called by the e2e plugin in every process of the run) starts a
daemon thread that waits until its process is a training worker (``WorkerDict`` in its Ray title), then samples
that count every :data:`INTERVAL_S` and writes its running maximum to ``<dir>/<pid>.json`` once a second. ctypes
releases the GIL during the call, and torch's ops run without it, so the samples land inside the ops too.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import threading
import time
from pathlib import Path

__all__ = ["HEAP_DIR_ENV", "INTERVAL_S", "start", "heap_in_use", "read_peaks"]

#: Directory for the per-process peak files; unset: no sampling.
HEAP_DIR_ENV = "ZORRO_E2E_HEAP_DIR"
#: Sampling period of a training worker (one sample costs ~20 us on its heap: ~1 % of a core).
INTERVAL_S = 0.002
_NEEDLES = ("WorkerDict", "ActorRolloutRef")
_started = False


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


@functools.cache
def _mallinfo2():
    """glibc's ``mallinfo2`` (loaded once), or None without it."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        f = libc.mallinfo2  # glibc >= 2.33
    except (OSError, AttributeError):
        return None
    f.restype = _MallInfo2
    return f


def heap_in_use() -> int:
    """Bytes of the C heap in use now (arenas + mmapped blocks); -1 without glibc's ``mallinfo2``."""
    f = _mallinfo2()
    if f is None:
        return -1
    m = f()
    return int(m.uordblks + m.hblkhd)


def _cmdline() -> str:
    try:
        return Path("/proc/self/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _run(out_dir: Path) -> None:
    while not any(n in _cmdline() for n in _NEEDLES):  # a Ray worker learns its actor class after start-up
        time.sleep(1.0)
    path, tmp = out_dir / f"{os.getpid()}.json", out_dir / f".{os.getpid()}.tmp"
    peak, written = 0, 0.0
    while True:
        peak = max(peak, heap_in_use())
        now = time.monotonic()
        if now - written >= 1.0:
            tmp.write_text(json.dumps({"pid": os.getpid(), "cmdline": _cmdline(), "peak_bytes": peak}))
            os.replace(tmp, path)  # the reader never sees half a file
            written = now
        time.sleep(INTERVAL_S)


def start() -> None:
    """Start the sampler of this process when :data:`HEAP_DIR_ENV` is set (idempotent; no-op without glibc)."""
    global _started
    d = os.environ.get(HEAP_DIR_ENV)
    if _started or not d or _mallinfo2() is None:
        return
    _started = True
    out = Path(d)
    out.mkdir(parents=True, exist_ok=True)
    threading.Thread(target=_run, args=(out,), daemon=True, name="zorro-heap-peak").start()


def read_peaks(out_dir: Path) -> dict:
    """``{pid: (cmdline, peak bytes)}`` of the files in ``out_dir`` (empty when there are none)."""
    peaks = {}
    for p in Path(out_dir).glob("*.json"):
        try:
            d = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        peaks[int(d["pid"])] = (d["cmdline"], int(d["peak_bytes"]))
    return peaks
