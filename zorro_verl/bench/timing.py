"""Measuring: the clock, resident memory (RSS, peak RSS) and glibc heap helpers, and the interleaved timer that
every benchmark of the package uses.

Times are milliseconds (float), memory MiB (float). Linux-only for the memory figures (``/proc/self``); elsewhere
the peak is reported as NaN with method ``none``.
"""

from __future__ import annotations

import ctypes
import os
import time
import weakref
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["Clock", "rss_bytes", "reset_peak_rss", "peak_rss_bytes", "steady_heap", "trim_heap", "time_interleaved",
           "LiveTensorBytes"]


class Clock:
    """``wall``: perf_counter (with a CUDA sync); ``cpu``: this process's CPU time — on a shared CPU host with one
    intra-op thread it does not count time other processes hold the cores."""

    def __init__(self, kind: str, cuda: bool):
        if kind not in ("wall", "cpu"):
            raise ValueError(f"--clock: expected 'wall' or 'cpu', got {kind!r}.")
        self.kind, self.cuda = kind, cuda

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter() if self.kind == "wall" else time.process_time()


def rss_bytes() -> int:
    """Resident set size of this process, bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter (VmHWM) of this process; False where not permitted."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """Peak resident set size (VmHWM) of this process since the last :func:`reset_peak_rss`, bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM line")


def steady_heap() -> None:
    """glibc: keep freed memory in the heap (no trimming; mmap only above 32 MiB) so that, after the warm-up, a
    step reuses pages instead of page-faulting fresh ones — a long-running training process's steady state, and
    the same for every variant whatever ran before it."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD (glibc's maximum)
    except (OSError, AttributeError):
        pass


def trim_heap() -> None:
    """Give freed heap back to the OS (``malloc_trim``) so that an RSS baseline taken next is honest."""
    # No gc.collect(): tensors are freed by refcount, and a full collection over transformers' objects costs ~1 s.
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def time_interleaved(variants: dict, batches: list, warmup: int, reps: int, clock: Clock,
                     reset: Callable[[], None], device: torch.device
                     ) -> tuple[dict[str, list[float]], dict[str, float], str]:
    """Run every variant ``warmup`` then ``reps`` times, interleaved run by run, on rotated batches.

    Args:
        variants: ``{name: (prepare, step)}``; ``prepare()`` runs outside the timer (e.g. switching the attention
            implementation), ``step(batch)`` is timed.
        batches: inputs, used in turn (run ``i`` takes ``batches[i % len(batches)]``).
        reset: called before every run and once at the end, outside the timer (drops gradients).

    Returns ``(times ms per variant, peak MiB per variant, memory method)``. Memory is measured outside the timer:
    on CUDA the allocator peak over the timed runs; on CPU the peak-RSS delta of the warm-up runs, each after
    handing freed heap back to the OS — never in a timed run, since the page faults that follow a heap trim would
    add a cost to the timed step that a training loop does not pay.
    """
    if warmup < 1 and device.type != "cuda":
        raise ValueError("--warmup: expected >= 1 on CPU (peak memory is measured in the warm-up runs).")
    times = {k: [] for k in variants}
    peaks = {k: 0.0 for k in variants}
    method = "cuda_allocator" if device.type == "cuda" else "rss_hwm"
    names = list(variants)
    for i in range(warmup + reps):
        batch = batches[i % len(batches)]
        timed = i >= warmup
        # rotate the order run by run: each variant follows each other one equally often (cache/heap state)
        for name in names[i % len(names):] + names[:i % len(names)]:
            prepare, step = variants[name]
            prepare()
            reset()
            measure = device.type == "cuda" or not timed
            if measure and device.type == "cuda":
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
            elif measure:
                trim_heap()
                before = rss_bytes()
                if not reset_peak_rss():
                    method = "none"
            t0 = clock.now()
            step(batch)
            t1 = clock.now()
            if measure:
                if device.type == "cuda":
                    peak = torch.cuda.max_memory_allocated(device) - before
                else:
                    peak = peak_rss_bytes() - before if method == "rss_hwm" else float("nan")
                peaks[name] = max(peaks[name], peak / 2**20)
            if timed:
                times[name].append((t1 - t0) * 1e3)
    reset()
    return times, peaks, method


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of the tensor storages that ops allocate while this mode is active, by torch's own accounting of
    storage sizes: deterministic, independent of the allocator and of other processes (unlike RSS).

    Every op output whose storage is not one of the op's inputs' (so views and in-place results of existing tensors
    are not counted) adds its storage's ``nbytes`` until that storage is freed (a finalizer on the storage object).
    Tensors that existed before the mode (inputs, parameters) count only through what the ops allocate. Autograd's
    backward runs its ops through the same dispatcher on CPU, so ``loss.backward()`` / ``torch.autograd.grad`` inside
    the mode are counted too. Code compiled with ``torch.compile`` does not run under a dispatch mode: measure it
    another way (peak RSS). Attributes: ``peak`` and ``live`` (bytes)."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}  # storage data_ptr -> nbytes, for storages allocated under the mode

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key, n = storage.data_ptr(), storage.nbytes()
            if n == 0 or key in inputs or key in self._sizes:
                continue
            self._sizes[key] = n
            self.live += n
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key)
        return out

    def _free(self, key: int) -> None:
        n = self._sizes.pop(key, None)
        if n is not None:
            self.live -= n
