"""The OpenRLHF tests that need OpenRLHF itself run only in .venv-openrlhf (scripts/setup_openrlhf_env.sh, a step of
scripts/test.sh): its pins (transformers 5.15) conflict with verl's. Anywhere else those modules skip at collection
(``require_openrlhf_env``); the tests of the OpenRLHF-free parts (settings, loader line, grouping) run everywhere.

In that environment flash_attn is absent; tests/support/openrlhf_stubs (see its README) stands in for the pure-torch
helpers OpenRLHF imports from it at module import time. It goes on ``sys.path`` only where the real package is
missing. DeepSpeed 0.19.6 is real there, on its CPU accelerator (``DS_ACCELERATOR=cpu``, set here unless set)."""

import importlib.util
import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
OPENRLHF_VENV = Path(os.environ.get("VENV_OPENRLHF", REPO_ROOT / ".venv-openrlhf")).resolve()
STUBS = REPO_ROOT / "tests" / "support" / "openrlhf_stubs"


def in_openrlhf_env() -> bool:
    return Path(sys.prefix).resolve() == OPENRLHF_VENV


def require_openrlhf_env() -> None:
    """Skip the calling test module outside .venv-openrlhf; inside it, make OpenRLHF importable (or fail)."""
    if not in_openrlhf_env():
        pytest.skip(f"needs OpenRLHF: runs in {OPENRLHF_VENV} (scripts/setup_openrlhf_env.sh)", allow_module_level=True)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # no accelerator probing when OpenRLHF imports deepspeed
    if importlib.util.find_spec("flash_attn") is None and str(STUBS) not in sys.path:
        sys.path.insert(0, str(STUBS))
