"""Fixtures for the verl 0.9 engine tests: CPU platform, a 1-process gloo group, the FSDP strategy (FSDP2 and FSDP1),
tiny Qwen3 checkpoints on disk.
Skips cleanly without verl 0.9 (fails instead when ZORRO_REQUIRE_VERL=1, as scripts/test.sh sets)."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from tests.support.verl_engines import STRATEGIES


def _verl_09():
    try:
        import importlib.metadata as md

        v = md.version("verl")
    except Exception:
        return None
    return v if v.startswith("0.9") else None


VERL_09 = _verl_09()
if VERL_09 is None and os.environ.get("ZORRO_REQUIRE_VERL") == "1":
    # scripts/test.sh sets this: in CI a missing verl must fail the run, not skip the engine tests.
    raise RuntimeError("ZORRO_REQUIRE_VERL=1 but verl 0.9.x is not installed; scripts/setup_env.sh installs it "
                       "(pip install -e '.[dev,verl]').")
needs_verl = pytest.mark.skipif(VERL_09 is None, reason="verl 0.9.x is not installed")


@pytest.fixture(scope="session")
def verl_cpu():
    """The CPU platform (installed before verl.workers.engine is imported, which resolves verl's platform), the
    zorro plugin loaded by `import verl`, and a 1-rank gloo group."""
    if VERL_09 is None:
        pytest.skip("verl 0.9.x is not installed")
    if torch.cuda.is_available():
        pytest.skip("the verl engine CPU tests run on CPU-only hosts")
    from tests.support.verl_cpu_platform import use_cpu_platform

    use_cpu_platform()
    os.environ.setdefault("VERL_ENGINE_DEVICE", "cpu")
    from zorro_verl.integrations.verl.v09 import registration

    assert registration.is_installed(), "`import verl` did not load zorro's verl.plugins entry point"
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", "0")
        # a file rendezvous in a fresh directory: no TCP port that another process could hold
        rendezvous = os.path.join(tempfile.mkdtemp(prefix="zorro-gloo-"), "rendezvous")
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=0, world_size=1)
    yield


@pytest.fixture(scope="module", params=STRATEGIES)
def strategy(request):
    """The FSDP strategy of the engines under test: ``fsdp2``, and ``fsdp`` (FSDP1, verl's default). Module scope, so
    a module's engines are built once per strategy."""
    return request.param


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """A tiny fp32 Qwen3 (GQA, 2 layers) saved as an HF checkpoint directory."""
    from zorro_verl.testing import tiny_model

    path = tmp_path_factory.mktemp("tiny_qwen3")
    model = tiny_model("qwen3", dtype=torch.float32, seed=0)
    model.config.architectures = ["Qwen3ForCausalLM"]
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(autouse=True)
def _fresh_balance_warnings():
    """Each test sees the trainer hook's warn-once messages afresh (they are once per process)."""
    try:
        from zorro_verl.integrations.verl.v09 import balance
    except ImportError:
        yield
        return
    balance._warned.clear()
    yield
