"""The TRL tests run only where trl 1.16 is installed (.venv-trl, scripts/setup_trl_env.sh, a step of
scripts/test.sh): its transformers (5.15) conflicts with verl's pin. Anywhere else every module here skips at
collection. Assets: a tiny Qwen3 built from a config and a byte-level BPE tokenizer trained offline (no hub)."""

import importlib.util

import pytest

if importlib.util.find_spec("trl") is None:
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session")
def trl_assets(tmp_path_factory):
    """(model dir, tokenizer) of the tiny fp32 Qwen3 (hidden 64, 2 layers, vocab 512) and its tokenizer."""
    from tests.support.trl_assets import build

    out = tmp_path_factory.mktemp("trl_tiny")
    return build(out)
