"""The end-to-end GRPO runs (verl ``main_ppo`` + CPU vLLM) run only in .venv-e2e (scripts/setup_e2e_env.sh), from
the last step of scripts/test.sh; anywhere else test_main_ppo.py skips at collection."""

import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
E2E_VENV = Path(__import__("os").environ.get("ZORRO_E2E_VENV", REPO_ROOT / ".venv-e2e")).resolve()


def in_e2e_env() -> bool:
    return Path(sys.prefix).resolve() == E2E_VENV


def pytest_configure(config):
    config.addinivalue_line("markers", "e2e: whole verl main_ppo GRPO runs (only in .venv-e2e)")


def pytest_terminal_summary(terminalreporter):
    mod = sys.modules.get("tests.e2e.test_main_ppo")
    report = getattr(mod, "REPORT", None) if mod is not None else None
    if report:
        terminalreporter.section("zorro e2e: verl main_ppo GRPO on CPU")
        for line in report:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def e2e_required():
    if not in_e2e_env():
        pytest.skip(f"end-to-end runs need {E2E_VENV}/bin/python (scripts/setup_e2e_env.sh)")
