"""The e2e runner's ``/dev/shm`` clean-up spares what a live process holds: two ``main_ppo`` runs side by side share
``/dev/shm``, and a run that ends must not unlink the other's segments (its vLLM engine or weight receiver opens them
by name later). Runs in the main suite (no verl, no subprocess)."""

import os
from multiprocessing import shared_memory

import pytest

from tests.e2e.runner import _shm_in_use

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm on this machine")


def test_mapped_segment_is_in_use_until_closed():
    shm = shared_memory.SharedMemory(create=True, size=4096)
    try:
        assert shm.name.lstrip("/") in _shm_in_use()
    finally:
        shm.close()
    try:
        assert shm.name.lstrip("/") not in _shm_in_use()
    finally:
        shm.unlink()


def test_open_descriptor_alone_counts():
    """A segment open (not mapped) by a process is in use too."""
    path = "/dev/shm/zorro_test_fd_only"
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        assert "zorro_test_fd_only" in _shm_in_use()
    finally:
        os.close(fd)
        os.unlink(path)
    assert "zorro_test_fd_only" not in _shm_in_use()
