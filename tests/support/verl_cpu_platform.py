"""A CPU platform for verl >= 0.9 so its FSDP engine runs on a host without accelerators (tests and CI only; it
does not ship with the package).

verl resolves its platform once, on the first ``get_platform()`` call, and falls back to 'nvidia'. Importing
``verl.workers.engine`` already resolves it, so :func:`use_cpu_platform` must run before that import. The tests call
it in their conftest; Ray workers get it from :mod:`tests.support.verl_cpu_plugin`, named in their
``VERL_USE_EXTERNAL_MODULES`` (verl imports those first at ``import verl``). It is refused when CUDA is available: a
GPU host must never silently run its engine on the CPU.
"""

from __future__ import annotations

import contextlib
import os

import torch

__all__ = ["use_cpu_platform", "worker_env"]


class _CPUDeviceModule:
    """Answers the ``torch.cuda``-style calls verl makes on its device module (memory stats are zeros)."""

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def current_device(self) -> str:
        return "cpu"

    def set_device(self, device=None) -> None:
        return None

    def synchronize(self, device=None) -> None:
        return None

    def get_device_name(self, device=None) -> str:
        return "cpu"

    def empty_cache(self) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    def mem_get_info(self, device=None) -> tuple[int, int]:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        avail = os.sysconf("SC_AVPHYS_PAGES")
        return avail * size, pages * size

    def memory_allocated(self, device=None) -> int:
        return 0

    memory_reserved = max_memory_allocated = max_memory_reserved = memory_allocated

    def reset_peak_memory_stats(self, device=None) -> None:
        return None

    def memory_stats(self, device=None) -> dict:
        return {}

    def __getattr__(self, name):
        raise AttributeError(f"zorro CPU platform: verl called torch.cuda-style '{name}', which the test CPU platform "
                             "does not provide. Add it to tests/support/verl_cpu_platform.py.")


def _platform_class():
    from verl.plugin.platform import PlatformBase

    class PlatformCPU(PlatformBase):
        """verl platform 'cpu': gloo collectives, torch CPU tensors, no profiler/IPC."""

        _module = _CPUDeviceModule()

        @property
        def device_name(self) -> str:
            return "cpu"

        @property
        def vendor_name(self) -> str:
            return "cpu"

        @property
        def device_module(self):
            return self._module

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check=False) -> bool:
            return not torch.cuda.is_available()

        def current_device(self):
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index) -> None:
            return None

        def synchronize(self, device_index=None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0):
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        @contextlib.contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self):
            return None

    return PlatformCPU


_installed = False


def use_cpu_platform() -> None:
    """Register verl platform 'cpu' and make it current, and let FSDP1 wrap CPU parameters
    (:func:`tests.support.fsdp1_cpu.allow_cpu_fsdp1`); idempotent. Refused when CUDA is available."""
    global _installed
    if _installed:
        return
    if torch.cuda.is_available():
        raise RuntimeError("zorro CPU platform: CUDA is available on this host; refusing to run verl's engine on the "
                           "CPU.")
    from verl.plugin.platform import PlatformRegistry, set_platform

    cls = PlatformRegistry.get("cpu")
    if cls is None:
        cls = PlatformRegistry.register(platform="cpu")(_platform_class())
    set_platform(cls())
    from tests.support.fsdp1_cpu import allow_cpu_fsdp1

    allow_cpu_fsdp1()
    _installed = True


def worker_env() -> dict:
    """Environment for processes (Ray workers, ``main_ppo`` subprocesses) that must run verl's engine on the CPU:
    the repository first on the path (so ``tests`` is this repository's package, not the one verl's wheel installs)
    and :mod:`tests.support.verl_cpu_plugin` imported at ``import verl``."""
    from tests.support import REPO_ROOT

    path = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": str(REPO_ROOT) + (os.pathsep + path if path else ""),
            "VERL_USE_EXTERNAL_MODULES": "tests.support.verl_cpu_plugin", "VERL_ENGINE_DEVICE": "cpu"}
